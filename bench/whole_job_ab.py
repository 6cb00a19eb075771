"""What distanom costs a whole job, resolved to a fraction of a percent: one job per
workload and variant under `torchrun -m distanom.launch`, its agent switched between
watching and inert every ~0.5 s (bench/workloads/ab_switch.py), in the job's own loop.

    python3 bench/whole_job_ab.py --out $OUT [--workloads resnet18,amp,hf,lightning]
        [--variants none,default,none+nopause] [--segments 80] [--segment-steps N]
        [--budget-s 540] [--warmup-s 0]

A job gets as many of the segments asked for as fit in what is left of --budget-s at the
workload's nominal step time (`segments_that_fit`): a job that runs past the caller's
own time limit comes back with nothing.

bench/whole_job.py compares whole processes (plain `torchrun` against
`-m distanom.launch`), which is what users pay but spreads by +-15-25% on the H200
machine. Here the same job holds both halves: segments of ~0.5 s, on, off, off, on, ...
Each adjacent (on, off) pair gives a ratio; the figure is their mean weighted by the on
segment's steps (on segments inside a traced window run longer), with a bootstrap 95%
interval (fixed seed), and the unweighted median. `spill_added`: the CPU time of distanom's
threads during off segments (rounds that ran over into them, periodic writes) added back
to the on side as if it had all taken the training thread's time: an upper bound.
What the inert half still has (the agent installed: optimizer wrapper, GC callback,
idle threads) and the launcher's start-up are not in the ratio; whole_job.py covers them.

Per segment the job records ms/step, distanom's boundary time, its threads' CPU time and
how often the training thread blocked (GIL hand-overs, roughly; summarized per half as
`*_training_blocks_per_step`), in `<out>/whole_job_ab.json` with device, torch version
and each job's segments. A variant may carry bench-only tweaks after a `+`:
`none+nopause` is detection with its rounds unpaced (`TWEAKS`). Unpaced, a round holds
the GIL in one piece: fewer hand-overs, but one longer step per round; read its ratio
with both in mind.

The ABBA estimate (`abba_*`, the figure to read): every four segments (on, off, off, on)
are one unit, whose log ratio (the on segments' ms per step over the off segments',
each half weighted by its steps) cancels a linear drift inside the unit; the ratio is
exp of the units' mean log ratio weighted by their on steps, with a Student-t 95%
interval (`abba_ci95`, `abba_halfwidth_pct`). `abba_trimmed_*`: the 10%-trimmed mean of
the units with Yuen's interval, narrower under the spikes of a loaded machine, unbiased
only where the cost is spread evenly over the units (it trims a traced window's unit as
readily as a noisy one). `abba_cpu_*`: the same over the process's CPU time per step
(no preemption by other processes in it; no GPU time either). `measured_min`: the
segments' own time. Tweaks for a known truth: `+sham` keeps the agent inert in both
halves (an A/A), `+spin<N>us` and `+spin<P>pct` busy-wait N us or P% of the step's time
at each step of an on segment; a sham job's `truth_ratio` is the spin measured, and
`covered` says whether each interval holds it. `abba_untraced_*`: the units with no
traced window (`split_by_tracing`), distanom's cost less tracing's; `tracing_pct`, the
rest: the two figures the report gives apart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from whole_job import REPO, VARIANTS, WORKLOADS, command, device_facts, git_commit

# steps per segment (~0.5 s each on the H200) and warm-up steps per workload
SEGMENT: dict[str, tuple[int, int]] = {
    "resnet18": (48, 300),
    "resnet18_b64": (40, 200),
    "amp": (24, 200),
    "compile": (48, 200),
    "compile_ro": (112, 300),
    "hf": (24, 200),
    "lightning": (64, 400),
}
# ms per step measured on the H200 (bench/results/whole_job_ab_h200_75da7fd.json;
# resnet18_b64: whole_job_ab_h200_7114d9d.json; compile*: whole_job_ab_compile_h200_be027ec.json),
# to turn --warmup-s into steps
NOMINAL_MS = {"resnet18": 8.7, "resnet18_b64": 12.0, "amp": 17.6, "compile": 10.0,
              "compile_ro": 4.4, "hf": 16.2, "lightning": 3.0}  # fmt: skip
# an on segment of an older result whose boundaries took this many times the median
# held a traced step (`split_by_tracing`)
TRACED_BOUNDARY_FACTOR = 1.3
# a job's start and end beyond its steps (torchrun, imports, the model's first steps; HF's
# Trainer is the slowest), when fitting its segments into what is left of --budget-s
JOB_OVERHEAD_S = 30.0
STEP_MARGIN = 1.1  # a step of the job over its nominal time, when fitting segments


def segments_that_fit(workload: str, segments: int, left_s: float, warmup_s: float,
                      segment_steps: int | None) -> int:  # fmt: skip
    """At most `segments`, as many as fit in `left_s` after the warm-up and the job's own
    start and end, at the workload's nominal step time and `STEP_MARGIN` more (the on
    half's cost, on segments run on to a traced window's end); 0 where fewer than two
    units fit: a job that runs past the budget is lost whole (its segments come back
    only when it ends)."""
    segment, warmup = SEGMENT[workload]
    segment = segment_steps or segment
    step_s = NOMINAL_MS[workload] * STEP_MARGIN / 1000
    warmup_steps = max(warmup, int(warmup_s * 1000 / NOMINAL_MS[workload]))
    room = left_s - JOB_OVERHEAD_S - warmup_steps * step_s
    fit = int(room / (segment * step_s))
    return min(segments, fit) if fit >= 8 else 0


# variant suffixes: a variant of VARIANTS with bench-only changes inside the job, through
# the environment (bench/workloads/ab_switch.py applies them): "none+nopause" is
# detection with its rounds unpaced (each pacer pause is a GIL hand-over)
TWEAKS: dict[str, dict[str, str]] = {
    "nopause": {"WHOLE_JOB_AB_NO_PAUSES": "1"},
    # the agent inert in both halves: an A/A, "on" only a label (with a spin: the truth)
    "sham": {"WHOLE_JOB_AB_SHAM": "1"},
}
# a known cost in the on half only: "spin200us" (200 us a step), "spin1pct" (1% a step)
SPIN = re.compile(r"spin(\d+(?:\.\d+)?)(us|pct)")
SPIN_KEYS = {"us": "WHOLE_JOB_AB_SPIN_US", "pct": "WHOLE_JOB_AB_SPIN_PCT"}


def tweak_env(tweak: str) -> dict[str, str] | None:
    """The environment a tweak sets in the job, or None for an unknown tweak."""
    if tweak in TWEAKS:
        return TWEAKS[tweak]
    spin = SPIN.fullmatch(tweak)
    return {SPIN_KEYS[spin.group(2)]: spin.group(1)} if spin else None


def split_variant(variant: str) -> tuple[str, list[str]]:
    """ "none+nopause" -> ("none", ["nopause"])."""
    base, *tweaks = variant.split("+")
    return base, tweaks


def known_variant(variant: str) -> bool:
    """A variant of VARIANTS other than "plain" (the A/B needs the agent), with known
    tweaks."""
    base, tweaks = split_variant(variant)
    return base != "plain" and base in VARIANTS and all(tweak_env(t) is not None for t in tweaks)


def run_job(
    workload: str,
    variant: str,
    segments: int,
    scratch: Path,
    warmup_s: float = 0.0,
    segment_steps: int | None = None,
) -> dict[str, Any]:
    """One job with the A/B switch (`warmup_s`: at least this long at the workload's
    nominal step time before the first segment; `segment_steps`: steps per segment
    instead of the workload's); its segments, wall time, exit status."""
    segment, warmup = SEGMENT[workload]
    segment = segment_steps or segment
    warmup = max(warmup, int(warmup_s * 1000 / NOMINAL_MS[workload]))
    steps = warmup + segments * segment
    result_path = scratch / f"{workload}-{variant}-{time.monotonic_ns()}.json"
    env = dict(os.environ, WHOLE_JOB_RESULT=str(result_path), PYTHONUNBUFFERED="1")
    env["WHOLE_JOB_AB_SEGMENT"] = str(segment)
    env["WHOLE_JOB_AB_WARMUP"] = str(warmup)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    base, tweaks = split_variant(variant)
    for keys in [*TWEAKS.values(), SPIN_KEYS.values()]:  # the variant's own, never the shell's
        for key in keys:
            env.pop(key, None)
    for tweak in tweaks:
        env.update(tweak_env(tweak) or {})
    started = time.monotonic()
    done = subprocess.run(
        command(workload, base, steps, scratch / "runs"),
        cwd=scratch, env=env, capture_output=True, text=True, timeout=590,
    )  # fmt: skip
    record: dict[str, Any] = {"variant": variant, "rc": done.returncode, "steps": steps}
    record["wall_s"] = round(time.monotonic() - started, 2)
    if done.returncode != 0 or not result_path.exists():
        record["stderr_tail"] = done.stderr[-2000:]
        return record
    record.update(json.loads(result_path.read_text()))
    record["summary"] = summarize(record.get("ab_segments", []))
    record["summary"].update(
        split_by_tracing(record.get("ab_segments", []), record.get("ab_segment"))
    )
    if "sham" in tweaks:  # the agent inert in both halves: the spin is all there is
        record["summary"].update(check_truth(record["summary"]))
    return record


def _pairs(segments: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Adjacent (on, off) segment pairs: segments 2k and 2k+1 hold one of each."""
    out = []
    for first, second in zip(segments[0::2], segments[1::2], strict=False):
        if first["on"] != second["on"]:
            out.append((first, second) if first["on"] else (second, first))
    return out


def summarize(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """The on/off ratio over pairs, each weighted by its on segment's steps (an on segment
    that ran on to the end of a traced window holds more of the job's steps: unweighted,
    the traced windows' cost would be diluted), its bootstrap interval, the unweighted
    median, and the spill bound."""
    pairs = _pairs(segments)
    if not pairs:
        return {"pairs": 0}
    ratios = [on["ms_per_step"] / off["ms_per_step"] for on, off in pairs]
    spill = [
        (on["ms_per_step"] + off["threads_cpu_us_per_step"] / 1e3) / off["ms_per_step"]
        for on, off in pairs
    ]
    weights = [float(on.get("steps", 1)) for on, _ in pairs]

    def weighted(values: list[float], picks: list[int]) -> float:
        total = sum(weights[i] for i in picks)
        return sum(values[i] * weights[i] for i in picks) / total

    every = list(range(len(pairs)))
    rng = random.Random(0)
    means = sorted(weighted(ratios, rng.choices(every, k=len(every))) for _ in range(2000))
    on_segments = [on for on, _ in pairs]
    off_segments = [off for _, off in pairs]
    return {
        "pairs": len(pairs),
        "mean_ratio": round(weighted(ratios, every), 5),
        "ci95": [round(means[49], 5), round(means[1949], 5)],
        "median_ratio": round(statistics.median(ratios), 5),
        "spill_added_mean_ratio": round(weighted(spill, every), 5),
        "pair_ratio_stdev": round(statistics.stdev(ratios), 5) if len(ratios) > 1 else None,
        "on_ms_per_step_median": round(statistics.median(s["ms_per_step"] for s in on_segments), 4),
        "off_ms_per_step_median": round(
            statistics.median(s["ms_per_step"] for s in off_segments), 4
        ),
        "on_boundary_us_per_step": round(
            statistics.fmean(s["boundary_us_per_step"] for s in on_segments), 2
        ),
        "on_threads_cpu_us_per_step": round(
            statistics.fmean(s["threads_cpu_us_per_step"] for s in on_segments), 2
        ),
        "off_threads_cpu_us_per_step": round(
            statistics.fmean(s["threads_cpu_us_per_step"] for s in off_segments), 2
        ),
        # GIL hand-overs, roughly: the training thread's blocks per step (None off Linux)
        "on_training_blocks_per_step": _mean_of(on_segments, "training_blocks_per_step"),
        "off_training_blocks_per_step": _mean_of(off_segments, "training_blocks_per_step"),
        **summarize_abba(segments),
    }


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (Cornish-Fisher expansion about the normal's; within 0.2% of
    the exact value for df >= 5 at p = 0.975)."""
    z = statistics.NormalDist().inv_cdf(p)
    return (
        z
        + (z**3 + z) / (4 * df)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
    )


def abba_units(
    segments: list[dict[str, Any]], key: str = "ms_per_step"
) -> list[tuple[float, float]]:
    """(log ratio, on steps) of every complete on, off, off, on unit (segments 4k to
    4k+3, in the order ab_switch.SegmentedAB runs them): each half's time per step over
    its steps, so a linear drift inside the unit cancels. Units with a segment lacking
    `key` (older results) are left out."""
    units = []
    for first in range(0, len(segments) - 3, 4):
        unit = segments[first : first + 4]
        if [s["on"] for s in unit] != [True, False, False, True]:
            continue
        if any(not s.get(key) or s[key] <= 0 for s in unit):
            continue
        on, off = (unit[0], unit[3]), (unit[1], unit[2])
        on_steps = sum(float(s.get("steps", 1)) for s in on)
        off_steps = sum(float(s.get("steps", 1)) for s in off)
        on_ms = sum(s[key] * float(s.get("steps", 1)) for s in on) / on_steps
        off_ms = sum(s[key] * float(s.get("steps", 1)) for s in off) / off_steps
        units.append((math.log(on_ms / off_ms), on_steps))
    return units


def weighted_t_interval(units: list[tuple[float, float]]) -> tuple[float, float, float]:
    """The weighted mean of the units' log ratios and its Student-t 95% interval (the
    weighted mean's sandwich standard error, n - 1 degrees of freedom)."""
    n = len(units)
    total = sum(w for _, w in units)
    mean = sum(x * w for x, w in units) / total
    if n < 2:
        return mean, -math.inf, math.inf
    var = n / (n - 1) * sum((w * (x - mean)) ** 2 for x, w in units) / total**2
    half = t_quantile(0.975, n - 1) * math.sqrt(var)
    return mean, mean - half, mean + half


def trimmed_interval(values: list[float], trim: float = 0.1) -> tuple[float, float, float]:
    """The `trim`-trimmed mean of `values` and Yuen's 95% interval (winsorized variance,
    h - 1 degrees of freedom, h the values kept)."""
    xs = sorted(values)
    n = len(xs)
    g = int(trim * n)
    h = n - 2 * g
    kept = xs[g : n - g]
    mean = statistics.fmean(kept)
    if h < 2:
        return mean, -math.inf, math.inf
    winsorized = [xs[g]] * g + kept + [xs[n - g - 1]] * g
    var = statistics.variance(winsorized) * (n - 1) / (h * (h - 1))
    half = t_quantile(0.975, h - 1) * math.sqrt(var)
    return mean, mean - half, mean + half


def _as_ratio(prefix: str, interval: tuple[float, float, float]) -> dict[str, Any]:
    """A log-scale interval as ratio fields: `<prefix>ratio`, `<prefix>ci95`,
    `<prefix>halfwidth_pct` (half the interval's width, in % of 1)."""
    mean, low, high = (math.exp(v) if math.isfinite(v) else None for v in interval)
    fields: dict[str, Any] = {f"{prefix}ratio": round(mean or 0.0, 5)}
    fields[f"{prefix}ci95"] = [None if v is None else round(v, 5) for v in (low, high)]
    fields[f"{prefix}halfwidth_pct"] = (
        None if low is None or high is None else round((high - low) / 2 * 100, 3)
    )
    return fields


def summarize_abba(segments: list[dict[str, Any]]) -> dict[str, Any]:
    """The ABBA estimate (module docstring): units, weighted mean with its t interval,
    trimmed mean with Yuen's, the same over CPU time, the injected spin's ratio where the
    segments paid one, and the minutes the segments took."""
    units = abba_units(segments)
    out: dict[str, Any] = {"abba_units": len(units)}
    out["measured_min"] = round(
        sum(s["ms_per_step"] * s.get("steps", 1) for s in segments) / 60e3, 3
    )
    if not units:
        return out
    out.update(_as_ratio("abba_", weighted_t_interval(units)))
    out.update(_as_ratio("abba_trimmed_", trimmed_interval([x for x, _ in units])))
    out["abba_unit_log_stdev"] = (
        round(statistics.stdev(x for x, _ in units), 5) if len(units) > 1 else None
    )
    cpu = abba_units(segments, "cpu_ms_per_step")
    if cpu:
        out.update(_as_ratio("abba_cpu_", weighted_t_interval(cpu)))
    if any(s.get("spin_us_per_step") for s in segments):
        # what the spin alone made of the on half: on time over on time less the spin
        spun = [
            {**s, "ms_per_step": s["ms_per_step"] - s.get("spin_us_per_step", 0.0) / 1e3}
            for s in segments
        ]
        injected = [
            (x_with - x_without, w)
            for (x_with, w), (x_without, _) in zip(units, abba_units(spun), strict=True)
        ]
        out["injected_ratio"] = round(math.exp(weighted_t_interval(injected)[0]), 5)
    return out


def split_by_tracing(segments: list[dict[str, Any]], segment_steps: int | None) -> dict[str, Any]:
    """The ABBA estimate over the units none of whose on segments held a traced step
    (its `traced_boundaries`): distanom's cost without tracing's, to compare with the
    report's own-time figure; the whole ratio less it is tracing's part, to compare with
    the duty cycle's effective figure. Older results have no count: there an on segment
    held one if it ran on past `segment_steps` (only one followed by an off segment
    does) or its boundaries took over `TRACED_BOUNDARY_FACTOR` times the on segments'
    median (a traced boundary takes ~2.7 times an untraced one on the H200, a switch
    milliseconds). Empty without a segment length."""
    if not segment_steps:
        return {}
    usual = statistics.median(
        [s.get("boundary_us_per_step", 0.0) for s in segments if s["on"]] or [0.0]
    )

    def traced(segment: dict[str, Any]) -> bool:
        if "traced_boundaries" in segment:
            return bool(segment["traced_boundaries"])
        heavy = segment.get("boundary_us_per_step", 0.0) > TRACED_BOUNDARY_FACTOR * usual
        return bool(segment.get("steps", 0) > segment_steps or heavy)

    units, plain = abba_units(segments), []
    for first in range(0, len(segments) - 3, 4):
        unit = segments[first : first + 4]
        if any(s["on"] and traced(s) for s in unit):
            continue
        plain.extend(abba_units(unit))
    if not units or not plain:
        return {}
    on_steps = sum(w for _, w in units)
    out = {"abba_untraced_units": len(plain)}
    out["extended_on_share"] = round(1 - sum(w for _, w in plain) / on_steps, 4)
    out.update(_as_ratio("abba_untraced_", weighted_t_interval(plain)))
    whole = math.exp(weighted_t_interval(units)[0])
    out["tracing_pct"] = round((whole - out["abba_untraced_ratio"]) * 100, 3)
    return out


def check_truth(summary: dict[str, Any]) -> dict[str, Any]:
    """For a sham job (the agent inert in both halves): the truth is the injected spin
    (1.0 without one); whether each interval holds it."""
    truth = summary.get("injected_ratio", 1.0)
    covered = {}
    for prefix in ("abba_", "abba_trimmed_", "abba_cpu_"):
        low, high = summary.get(f"{prefix}ci95") or (None, None)
        if low is not None and high is not None:
            covered[prefix.rstrip("_")] = bool(low <= truth <= high)
    low, high = summary.get("ci95") or (None, None)
    if low is not None and high is not None:
        covered["pairs"] = bool(low <= truth <= high)
    return {"truth_ratio": truth, "covered": covered}


def _mean_of(segments: list[dict[str, Any]], key: str) -> float | None:
    """The mean of `key` over segments that have it (None if none does)."""
    values = [s[key] for s in segments if s.get(key) is not None]
    return round(statistics.fmean(values), 4) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "whole_job_ab")))
    parser.add_argument("--workloads", default="resnet18,amp,hf,lightning")
    parser.add_argument("--variants", default="none,default")
    parser.add_argument("--segments", type=int, default=80)
    parser.add_argument(
        "--segment-steps", type=int, default=None,
        help="steps per segment for every workload (default: the workload's, ~0.2-0.5 s on "
        "the H200)",
    )  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument(
        "--warmup-s", type=float, default=0.0,
        help="run this long before the first segment (the duty cycle's start-up: its first "
        "windows measure the tracer, and a run's first anomalies are planned from there)",
    )  # fmt: skip
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [w for w in workloads if w not in SEGMENT] + [
        v for v in variants if not known_variant(v)
    ]
    if unknown:
        print(f"whole_job_ab: unknown workload or variant: {', '.join(unknown)}", file=sys.stderr)
        return 2
    assert set(SEGMENT) <= set(WORKLOADS)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    report: dict[str, Any] = {"facts": device_facts(), "args": dict(vars(args)), "jobs": []}
    report["args"]["out"] = str(args.out)
    report["facts"]["distanom_commit"] = os.environ.get("DISTANOM_COMMIT") or git_commit()
    # the machine's load (other work shares a CPU VM) and the jobs' CPU threads
    report["facts"]["cpu_count"] = os.cpu_count()
    report["facts"]["loadavg_start"] = list(os.getloadavg())
    report["facts"]["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    with tempfile.TemporaryDirectory() as scratch_name:
        for workload in workloads:
            for variant in variants:
                if time.monotonic() - started > args.budget_s:
                    break
                left_s = args.budget_s - (time.monotonic() - started)
                segments = segments_that_fit(
                    workload, args.segments, left_s, args.warmup_s, args.segment_steps
                )
                if not segments:  # two units would not end inside the budget
                    print(f"[{workload} {variant}] skipped: {left_s:.0f} s left", flush=True)
                    break
                job = run_job(
                    workload, variant, segments, Path(scratch_name), args.warmup_s,
                    args.segment_steps,
                )  # fmt: skip
                job["segments_asked"], job["segments_run"] = args.segments, segments
                job["workload"] = workload
                report["jobs"].append(job)
                print(f"[{workload} {variant}] rc {job['rc']} {job.get('wall_s')} s "
                      f"{json.dumps(job.get('summary'))}", flush=True)  # fmt: skip
                (args.out / "whole_job_ab.json").write_text(json.dumps(report, indent=1))
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    report["facts"]["loadavg_end"] = list(os.getloadavg())
    (args.out / "whole_job_ab.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
