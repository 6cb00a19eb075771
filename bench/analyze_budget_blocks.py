"""Where does the 1% budget's cost land? Per-step analysis of bench/overhead.py blocks.

    python3 bench/analyze_budget_blocks.py bench/results/overhead_resnet18.json

Reads a result of `bench/overhead.py --variants cupti_budget1 --per-step` and, for each
process, compares every step of the governed blocks with the median step of the
tracing-off block of the same pair (its local baseline). Governed steps are grouped by
their distance to the nearest traced step (before and after), so a cost that lingers
after a burst of traced windows, or one that comes before it, shows as an excess in the
bins close to the burst; the traced steps are a group of their own. Prints, per group,
the steps, the mean excess per step (ms) and its share of the whole governed time. Then
the pairs whose governed block held no traced step: the mean of their governed/off
ratios, with its standard error (a cost that is not tied to the bursts shows here).
Runs anywhere (no GPU): it only reads the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BINS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, 256), (257, 10**9))


def _bin(distance: int | None) -> str:
    if distance is None:
        return "none"
    for lo, hi in BINS:
        if lo <= distance <= hi:
            return f"{lo}-{hi}" if hi < 10**9 else f">={lo}"
    return "none"


def _distances(traced: list[int]) -> tuple[list[int | None], list[int | None]]:
    """Steps since the last traced step, and until the next one (None: no such step)."""
    since: list[int | None] = []
    last: int | None = None
    for i, t in enumerate(traced):
        if t:
            last = i
        since.append(None if last is None else i - last)
    until: list[int | None] = [None] * len(traced)
    nxt: int | None = None
    for i in range(len(traced) - 1, -1, -1):
        if traced[i]:
            nxt = i
        until[i] = None if nxt is None else nxt - i
    return since, until


def analyze(blocks: dict[str, Any]) -> dict[str, Any]:
    """One process's budget blocks (with `steps_ms`) → excess by group."""
    steps = blocks.get("steps_ms")
    if not steps:
        raise ValueError("no per-step data: run bench/overhead.py with --per-step")
    off_median: dict[int, float] = {}
    by_block: dict[int, list[float]] = defaultdict(list)
    for block_no, _, ms in steps:
        by_block[block_no].append(ms)
    for block_no, values in by_block.items():
        if block_no % 2 == 1:
            off_median[block_no // 2] = statistics.median(values)
    governed = [(b, t, ms) for b, t, ms in steps if b % 2 == 0 and b // 2 in off_median]
    traced = [t for _, t, _ in governed]
    since, until = _distances(traced)
    groups: dict[str, list[float]] = defaultdict(list)
    total_ms = 0.0
    for (block_no, t, ms), s, u in zip(governed, since, until, strict=True):
        excess = ms - off_median[block_no // 2]
        total_ms += ms
        if t:
            groups["traced"].append(excess)
        else:
            groups[f"after {_bin(s)}"].append(excess)
            groups[f"before {_bin(u)}"].append(excess)
    clean_ratios = [
        statistics.fmean(by_block[2 * pair]) / statistics.fmean(by_block[2 * pair + 1])
        for pair in off_median
        if 2 * pair in by_block and not any(t for b, t, _ in governed if b == 2 * pair)
    ]
    clean: dict[str, Any] = {"pairs": len(clean_ratios), "mean_pct": None, "se_pct": None}
    if clean_ratios:
        clean["mean_pct"] = round((statistics.fmean(clean_ratios) - 1) * 100, 3)
    if len(clean_ratios) > 1:
        se = statistics.stdev(clean_ratios) / len(clean_ratios) ** 0.5
        clean["se_pct"] = round(se * 100, 3)
    return {
        "governed_steps": len(governed),
        "clean_pairs": clean,
        "traced_steps": sum(traced),
        "groups": {
            name: {
                "steps": len(values),
                "mean_excess_ms": round(statistics.mean(values), 4),
                "share_of_governed_pct": round(100 * sum(values) / total_ms, 3),
            }
            for name, values in sorted(groups.items())
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="bench/overhead.py result JSON")
    args = parser.parse_args(argv)
    try:
        data = json.loads(args.result.read_text())
        processes = data["variants"]["cupti_budget1"]["budget_blocks"]
    except (OSError, ValueError, KeyError) as err:
        print(f"{args.result}: not a cupti_budget1 result ({err})", file=sys.stderr)
        return 2
    for i, blocks in enumerate(processes):
        try:
            result = analyze(blocks)
        except ValueError as err:
            print(f"{args.result}: process {i}: {err}", file=sys.stderr)
            return 2
        print(
            f"process {i}: {result['governed_steps']} governed steps, "
            f"{result['traced_steps']} traced"
        )
        for name, g in result["groups"].items():
            print(
                f"  {name:16s} {g['steps']:6d} steps  excess {g['mean_excess_ms']:+8.4f} ms/step"
                f"  = {g['share_of_governed_pct']:+7.3f}% of governed time"
            )
        clean = result["clean_pairs"]
        print(
            f"  pairs without a traced step: {clean['pairs']}, governed/off "
            f"{clean['mean_pct']}% (standard error {clean['se_pct']}%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
