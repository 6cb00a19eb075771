"""The detector's rolling window: its median is statistics.median of the last values, its
spread the median absolute deviation of them."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distanom.rolling import SPREAD_EVERY, RollingWindow, kth_deviation


@given(
    maxlen=st.integers(1, 12),
    values=st.lists(st.one_of(st.floats(0.0, 1e6), st.just(math.nan)), max_size=60),
)
def test_median_is_that_of_the_last_finite_values(maxlen: int, values: list[float]) -> None:
    window = RollingWindow(maxlen)
    kept: list[float] = []
    for value in values:
        window.append(value)
        if math.isfinite(value):
            kept = [*kept, value][-maxlen:]
        assert list(window) == kept and len(window) == len(kept)
        if kept:
            assert window.median() == statistics.median(kept)


def test_an_empty_window_has_no_median() -> None:
    with pytest.raises(ValueError):
        RollingWindow(3).median()


@given(
    values=st.lists(
        st.one_of(st.floats(0.0, 1e6), st.sampled_from([1.0, 2.0, 3.0])), min_size=1, max_size=40
    ),
    middle=st.one_of(st.none(), st.floats(-10.0, 1e6)),
)
def test_kth_deviation_is_the_sorted_deviations(values: list[float], middle: float | None) -> None:
    values = sorted(values)
    at = statistics.median(values) if middle is None else middle
    deviations = sorted(abs(value - at) for value in values)
    assert [kth_deviation(values, at, k) for k in range(len(values))] == deviations


@given(values=st.lists(st.floats(0.0, 1e6), min_size=1, max_size=60), maxlen=st.integers(1, 30))
def test_the_spread_is_the_median_absolute_deviation_of_the_window(
    values: list[float], maxlen: int
) -> None:
    window = RollingWindow(maxlen)
    for value in values:
        window.append(value)
    kept = values[-maxlen:]
    middle = statistics.median(kept)
    assert window.spread() == statistics.median(abs(value - middle) for value in kept)
    for value in values[: SPREAD_EVERY - 1]:  # fewer appends than SPREAD_EVERY: kept as it was
        window.append(value)
    assert window.spread() == statistics.median(abs(value - middle) for value in kept)
