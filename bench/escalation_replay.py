"""Which episode rule catches injected delays in real step-time jitter? A CPU replay.

    python3 bench/escalation_replay.py bench/results/overhead_resnet18_budget.json \
        --out bench/results/escalation_replay_h200_series.json

The detector merges anomalous steps at most `merge_gap_steps` apart into one episode and
captures a later step of an episode only when it escalates. On the H200 end-to-end run a
10 ms delay 3 steps after a 1.55x jitter step was lost under the former rule (twice the
episode's captured ratio); the current rule asks a third more slowdown (ratio - 1).

This replays real step times through `distanom.detect.Detector` under both rules, side
by side on the same series and injections: the untraced host step times of the ResNet18
bf16 batch 5 budget run on the H200 (`--per-step` blocks of bench/overhead.py, ~8,000
steps per process, in order). A delay of D ms is added to one step in every `--every`
(at a random offset), for several D. Per rule and D: injected steps, how many the
detector judged anomalous, how many it captured, and the captures of other steps (the
cost of a looser rule). Runs anywhere: it only reads the JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from distanom.config import CaptureConfig, DetectConfig  # noqa: E402
from distanom.detect import Detector, Episode, StepSample  # noqa: E402


class FormerRuleDetector(Detector):
    """The rule before this change, for comparison: twice the captured step's ratio."""

    @staticmethod
    def _escalates(ratio: float, episode: Episode) -> bool:
        return ratio >= 2.0 * episode.captured_ratio


RULES: dict[str, type[Detector]] = {"current": Detector, "former": FormerRuleDetector}


def load_series(result: Path) -> list[list[float]]:
    """Per process: the untraced steps' host ms, in the order they ran."""
    data = json.loads(result.read_text())
    processes = data["variants"]["cupti_budget1"]["budget_blocks"]
    return [[ms for _, traced, ms in p["steps_ms"] if not traced] for p in processes]


def replay(
    series: list[float], rule: type[Detector], delay_ms: float, every: int, seed: int
) -> dict[str, int]:
    rng = random.Random(seed)
    injected = {
        start + rng.randrange(every // 4, every - every // 4)
        for start in range(every, len(series) - every, every)
    }
    detector = rule(DetectConfig(), CaptureConfig(max_captures=1_000_000, reference_every_steps=0))
    captured: set[int] = set()
    anomalous: set[int] = set()
    for step, ms in enumerate(series):
        ms = ms + delay_ms if step in injected else ms
        threshold = detector.threshold_before(StepSample(step, (ms,), True))
        decisions = detector.observe(StepSample(step, (ms,), True))
        if ms > threshold:  # NaN while not judged: False
            anomalous.add(step)
        captured.update(d.step for d in decisions if d.kind == "anomaly")
    return {
        "injected": len(injected),
        "injected_anomalous": len(injected & anomalous),
        "injected_captured": len(injected & captured),
        "other_captures": len(captured - injected),
        "steps": len(series),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="bench/overhead.py --per-step result")
    parser.add_argument("--delays-ms", default="6,8,10,15,30")
    parser.add_argument("--every", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        series = load_series(args.result)
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"{args.result}: not a --per-step cupti_budget1 result ({err})", file=sys.stderr)
        return 2
    delays = [float(d) for d in args.delays_ms.split(",")]
    out: dict[str, Any] = {
        "source": str(args.result),
        "every": args.every,
        "seeds": args.seeds,
        "processes": len(series),
        "median_step_ms": sorted(ms for s in series for ms in s)[sum(map(len, series)) // 2],
        "rules": {},
    }
    for name, rule in RULES.items():
        rows = {}
        for delay in delays:
            total: dict[str, int] = {}
            for seed in range(args.seeds):
                for p, s in enumerate(series):
                    for key, value in replay(s, rule, delay, args.every, seed * 100 + p).items():
                        total[key] = total.get(key, 0) + value
            rows[f"{delay:g}"] = total
            print(
                f"{name:8s} +{delay:4g} ms: captured {total['injected_captured']}/"
                f"{total['injected']} injected ({total['injected_anomalous']} over the "
                f"threshold), {total['other_captures']} other captures in {total['steps']} steps"
            )
        out["rules"][name] = rows
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
