"""bench/escalation_replay.py on a planted series: the current episode rule captures a
delay that follows a jitter step; the former one (kept in the script to compare) did not."""

from __future__ import annotations

import random
from types import ModuleType

from bench.tests.scripts import load_bench_script


def load_script() -> ModuleType:
    return load_bench_script("escalation_replay")


def test_a_delay_after_jitter_is_captured_by_the_current_rule_only() -> None:
    script = load_script()
    every = 40
    series = [10.0] * 400
    rng = random.Random(7)  # the replay's own draws of the injected steps
    injected = sorted(
        start + rng.randrange(every // 4, every - every // 4)
        for start in range(every, len(series) - every, every)
    )
    for step in injected:  # a 1.55x jitter step 3 steps before each
        series[step - 3] = 15.5
    current = script.replay(series, script.RULES["current"], 8.0, every, seed=7)
    former = script.replay(series, script.RULES["former"], 8.0, every, seed=7)
    assert current["injected"] == former["injected"] == len(injected)
    assert current["injected_captured"] == len(injected)
    assert former["injected_captured"] == 0
    assert current["other_captures"] == former["other_captures"] == len(injected)
