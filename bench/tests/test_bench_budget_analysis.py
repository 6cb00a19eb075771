"""bench/analyze_budget_blocks.py on synthetic per-step block data: it must put a cost
where it was planted (the device runs it on real data)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from bench.tests.scripts import load_bench_script


def load_script() -> ModuleType:
    return load_bench_script("analyze_budget_blocks")


def synthetic_blocks(linger_ms: float, clean_ms: float = 0.0) -> dict[str, object]:
    """64 pairs of 32-step blocks at 10 ms a step; one governed block in 8 holds 8 traced
    steps (+2 ms each); the 3 untraced steps after each burst cost `linger_ms` more; every
    step of the other governed blocks costs `clean_ms` more."""
    steps: list[tuple[int, int, float]] = []
    for pair in range(64):
        for block_no in (2 * pair, 2 * pair + 1):
            governed = block_no % 2 == 0
            burst = governed and pair % 8 == 3
            for i in range(32):
                traced = burst and 10 <= i < 18
                ms = 10.0 + (2.0 if traced else 0.0)
                if burst and 18 <= i < 21:
                    ms += linger_ms
                if governed and not burst:
                    ms += clean_ms
                steps.append((block_no, int(traced), ms))
    return {"steps_ms": steps}


def test_a_cost_after_the_bursts_lands_in_the_after_bins() -> None:
    script = load_script()
    result = script.analyze(synthetic_blocks(linger_ms=5.0))
    groups = result["groups"]
    assert result["traced_steps"] == 8 * 8
    assert groups["traced"]["mean_excess_ms"] == pytest.approx(2.0)
    assert groups["after 1-1"]["mean_excess_ms"] == pytest.approx(5.0)
    assert groups["after 2-4"]["mean_excess_ms"] == pytest.approx(5.0 * 2 / 3, abs=1e-4)
    assert groups["after 5-16"]["mean_excess_ms"] == pytest.approx(0.0)
    assert groups["before 5-16"]["mean_excess_ms"] == pytest.approx(0.0)


def test_without_a_lingering_cost_every_untraced_bin_reads_zero() -> None:
    script = load_script()
    groups = script.analyze(synthetic_blocks(linger_ms=0.0))["groups"]
    untraced = {name: g for name, g in groups.items() if name != "traced"}
    assert untraced and all(g["mean_excess_ms"] == 0.0 for g in untraced.values())


def test_a_result_without_per_step_data_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = load_script()
    result = tmp_path / "overhead_resnet18.json"
    blocks = {"governed": [], "off": []}
    result.write_text(json.dumps({"variants": {"cupti_budget1": {"budget_blocks": [blocks]}}}))
    assert script.main([str(result)]) == 2
    assert "run bench/overhead.py with --per-step" in capsys.readouterr().err


def test_a_cost_away_from_the_bursts_shows_in_the_clean_pairs() -> None:
    script = load_script()
    clean = script.analyze(synthetic_blocks(linger_ms=5.0, clean_ms=0.1))["clean_pairs"]
    assert clean["pairs"] == 64 - 8
    assert clean["mean_pct"] == pytest.approx(1.0)
    assert clean["se_pct"] == pytest.approx(0.0, abs=1e-9)


def test_a_cost_inside_the_burst_blocks_leaves_the_clean_pairs_at_zero() -> None:
    script = load_script()
    clean = script.analyze(synthetic_blocks(linger_ms=5.0))["clean_pairs"]
    assert clean["pairs"] == 56 and clean["mean_pct"] == pytest.approx(0.0)
