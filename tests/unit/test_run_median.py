"""run_median.RunMedian: the median of every step time counted, within its bins' 0.25%,
whatever the order; untimed steps left out."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from distanom.run_median import RunMedian


def test_nothing_counted_has_no_median() -> None:
    assert RunMedian().median_ms() is None
    only_untimed = RunMedian()
    only_untimed.add_many([math.nan, math.inf, 0.0, -1.0, 1.7e308])  # the last: damage
    assert only_untimed.median_ms() is None and only_untimed.steps == 0


def test_the_median_of_a_drifting_run_is_the_whole_runs_not_its_ends() -> None:
    rng = random.Random(7)
    # three minutes drifting from ~2.5 to ~3.3 ms (as session 26's Lightning job did),
    # a few very slow steps, some untimed ones, in rounds of 64
    times = [2.5 + 0.8 * i / 10_000 + rng.gauss(0, 0.05) for i in range(10_000)]
    times[100:105] = [400.0] * 5
    median = RunMedian()
    for at in range(0, len(times), 64):
        median.add_many([*times[at : at + 64], math.nan])
    assert median.steps == len(times)
    assert median.median_ms() == pytest.approx(statistics.median(times), rel=0.003)
    assert median.median_ms() < statistics.median(times[-500:]) - 0.3  # not the end's


@pytest.mark.parametrize("values", [[1e-3], [5.0, 5.0, 7.0], [0.2, 9e5, 30.0, 31.0]])
def test_small_and_extreme_runs(values: list[float]) -> None:
    median = RunMedian()
    median.add_many(values)
    expected = sorted(values)[(len(values) - 1) // 2]  # the lower middle, as the bins give
    assert median.median_ms() == pytest.approx(expected, rel=0.003)
