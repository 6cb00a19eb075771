"""The detector's rolling window: its median is statistics.median of the last values."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distanom.rolling import RollingWindow


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
