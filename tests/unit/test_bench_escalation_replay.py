"""bench/escalation_replay.py on a planted series: the current episode rule captures a
delay that follows a jitter step; the former one (kept in the script to compare) did not."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "escalation_replay.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("escalation_replay", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
