"""Which of distanom's own activities overlap the slow steps of a healthy GPU loop.

Runs tests/e2e/scripts/phases_train.py (CUDA, 1 rank, ~2 ms steps) under
`torchrun -m distanom.launch` and under plain torchrun, each with this file as the
torchrun entry point (`--as-entry`): it wraps distanom's own activities (the control
thread's rounds, evidence polls and Flight Recorder reads, file writes; the capture
worker; CUPTI's buffer callbacks and switches) to record when each ran and on which
thread, and runs a sampler thread that sleeps 1 ms at a time and records how late it
woke (a late wake-up is a thread that could not get the GIL). The script records each
step's start (`--step-times`).

For each activity, the report gives how often a slow step (over 1.5x / 3x the median)
overlaps it against how often any step does (the lift), and the sampler's late
wake-ups inside slow steps against all steps, per run.

`STALL_MAP_WIDE=1` in a variant's env wraps every method of the control side's classes
as well (the control loop, evidence tier, detector, duty cycle, journal, request desk,
metrics, consensus group). The judged anomalies of each distanom run (`distanom report
--json`) get the same view.

    python3 bench/probes/stall_map.py [--steps 2500] [--runs 1] [--variants JSON] --out FILE
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "e2e" / "scripts" / "phases_train.py"
LATE_NS = 300_000  # a 1 ms sleep that overran by this much counts as a late wake-up


def _install(out: str) -> None:
    """In the rank process: wrap the activities, start the sampler, dump at exit."""
    events: list[tuple[str, int, int, str]] = []
    late: list[tuple[int, int]] = []
    stop = threading.Event()

    def wrap(owner: object, attr: str, name: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return

        def timed(*args: object, **kwargs: object) -> object:
            began = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                events.append(
                    (name, began, time.perf_counter_ns(), threading.current_thread().name)
                )

        setattr(owner, attr, timed)

    try:
        import distanom.boundary as boundary
        import distanom.capture as capture
        import distanom.control_loop as control_loop
        import distanom.evidence as evidence
        import distanom.side_link as side_link
        import distanom.tracers.cupti.buffers as buffers
        import distanom.tracers.cupti.tracer as cupti_tracer

        loop, tracer = control_loop.ControlLoop, cupti_tracer.CuptiTracer
        for owner, attr, name in (
            (evidence, "read_entries", "fr_read"),
            (evidence.EvidenceCollector, "poll", "evidence_poll"),
            (loop, "_run_round", "round"),
            (side_link.SideSteps, "flush", "steps_flush"),  # the side process's, or here
            (loop, "_write_status", "status_write"),
            (side_link.SideSteps, "write", "log_steps"),
            (boundary.StepBoundaries, "collect", "collect"),  # event reads, step records
            (capture.CaptureWorker, "_handle", "capture_handle"),  # a decision re-run in a pass
            (capture.CaptureWorker, "_fetch", "capture_fetch"),  # the tracer's events
            (capture.CaptureWorker, "_written", "capture_write"),  # decode, encode: pauses in
            (capture.CaptureWorker, "_analyze", "capture_analyze"),
            (buffers.BufferPool, "complete", "cupti_complete"),
            (buffers.BufferPool, "request", "cupti_request"),
            (tracer, "_toggle", "cupti_toggle"),
            (tracer, "_detach", "cupti_detach"),
            (tracer, "step_trace", "cupti_step_trace"),
        ):
            wrap(owner, attr, name)
        if os.environ.get("STALL_MAP_WIDE") == "1":  # every method of the control side
            import inspect

            import distanom.anomaly_journal as journal
            import distanom.detect as detect
            import distanom.duty_cycle as duty_cycle
            import distanom.metrics as metrics
            import distanom.request_desk as request_desk
            import distanom.world as world

            skip = {"_main", "_round_loop", "_run_round", "_write_status", "poll"}
            for owner in (
                control_loop.ControlLoop, evidence.EvidenceTier, detect.Detector,
                duty_cycle.DutyCycle, journal.AnomalyJournal, request_desk.RequestDesk,
                metrics.NodeMetrics, world.AgentGroup,
            ):  # fmt: skip
                for attr, value in list(vars(owner).items()):
                    if inspect.isfunction(value) and attr not in skip and attr != "__init__":
                        wrap(owner, attr, f"{owner.__name__}.{attr}")
    except ImportError:
        pass  # plain torchrun: the sampler alone

    def sample() -> None:
        while not stop.is_set():
            began = time.perf_counter_ns()
            time.sleep(0.001)
            over = time.perf_counter_ns() - began - 1_000_000
            if over > LATE_NS:
                late.append((began, over))

    threading.Thread(target=sample, name="stall-sampler", daemon=True).start()

    def dump() -> None:
        stop.set()
        rank = os.environ.get("RANK", "0")
        with open(f"{out}.activity.rank{rank}.json", "w") as handle:
            json.dump({"events": events, "late": late}, handle)

    atexit.register(dump)


def _entry() -> None:
    """torchrun runs this file: `--as-entry OUT [plain|distanom] ARGS...`."""
    out, mode, rest = sys.argv[2], sys.argv[3], sys.argv[4:]
    _install(out)
    if mode == "plain":
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")
    else:
        sys.argv = ["distanom.launch", *rest]
        runpy.run_module("distanom.launch", run_name="__main__", alter_sys=True)


def _overlaps(spans: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Total ns of `spans` (sorted by start) inside [lo, hi)."""
    return sum(max(0, min(b, hi) - max(a, lo)) for a, b in spans if a < hi and b > lo)


def analyse(prefix: str, anomalous: list[int] | None = None) -> dict:
    """Slow steps against activities, for one job."""
    found = json.loads(Path(f"{prefix}.rank0.json").read_text())
    starts = found.get("starts_ns", [])
    activity = json.loads(Path(f"{prefix}.activity.rank0.json").read_text())
    # a step of distanom's ends at its optimizer.step, a little before the script's next
    # batch: step i here runs from batch i to batch i + 1 (the first 20, warm-up, left out)
    numbered = list(itertools.pairwise(starts))
    steps = numbered[20:]
    if not steps:
        return {"steps": 0}
    durations = [b - a for a, b in steps]
    median = statistics.median(durations)
    by_name: dict[str, list[tuple[int, int]]] = {}
    for name, began, ended, thread in activity["events"]:
        by_name.setdefault(f"{name}@{thread.split('-')[-1][:10]}", []).append((began, ended))
    late = sorted((a, a + over) for a, over in activity["late"])
    classes = {
        "all": [True] * len(steps),
        "over_1.5x": [d > 1.5 * median for d in durations],
        "over_3x": [d > 3 * median for d in durations],
    }
    result: dict = {
        "steps": len(steps),
        "median_ms": round(median / 1e6, 4),
        "counts": {k: sum(v) for k, v in classes.items()},
        "late_wakeups": len(late),
    }
    per_activity: dict[str, dict] = {}
    for name, spans in sorted(by_name.items()):
        spans.sort()
        lengths = [b - a for a, b in spans]
        row: dict = {
            "calls": len(spans),
            "median_us": round(statistics.median(lengths) / 1e3, 1),
            "max_ms": round(max(lengths) / 1e6, 3),
        }
        for label, chosen in classes.items():
            picked = [s for s, keep in zip(steps, chosen, strict=True) if keep]
            hit = sum(1 for lo, hi in picked if _overlaps(spans, lo, hi) > 0)
            row[f"share_{label}"] = round(hit / max(len(picked), 1), 3)
        per_activity[name] = row
    result["activities"] = per_activity
    for label, chosen in classes.items():
        picked = [s for s, keep in zip(steps, chosen, strict=True) if keep]
        hit = sum(1 for lo, hi in picked if _overlaps(late, lo, hi) > 0)
        result[f"late_share_{label}"] = round(hit / max(len(picked), 1), 3)

    def detail(lo: int, hi: int) -> dict:
        return {
            "ms": round((hi - lo) / 1e6, 2),
            "overlapping": sorted(
                {n: round(_overlaps(s, lo, hi) / 1e6, 2) for n, s in by_name.items()
                 if _overlaps(s, lo, hi) > 0}.items()
            ),
            "late_ms": round(_overlaps(late, lo, hi) / 1e6, 2),
        }  # fmt: skip

    # distanom's step N ends at its optimizer.step: it holds the script's fetch of batch N
    # (the end of the script's step N - 1) and the rest of the script's step N
    result["anomaly_detail"] = [
        {"step": step, **detail(starts[step - 1], starts[step + 1])}
        for step in (anomalous or [])[:60]
        if 1 <= step < len(starts) - 1
    ]
    slow = [(lo, hi) for (lo, hi), keep in zip(steps, classes["over_3x"], strict=True) if keep]
    result["over_3x_detail"] = [
        {
            "ms": round((hi - lo) / 1e6, 2),
            "overlapping": sorted(
                {n: round(_overlaps(s, lo, hi) / 1e6, 2) for n, s in by_name.items()
                 if _overlaps(s, lo, hi) > 0}.items()
            ),
            "late_ms": round(_overlaps(late, lo, hi) / 1e6, 2),
        }
        for lo, hi in slow[:40]
    ]  # fmt: skip
    return result


def one_job(
    mode: str, steps: int, scratch: Path, sets: list[str], cuda: bool = True,
    extra_env: dict[str, str] | None = None,
) -> dict:  # fmt: skip
    run_dir = scratch / f"runs-{time.monotonic_ns()}"
    prefix = str(scratch / f"times-{time.monotonic_ns()}")
    launch = [] if mode == "plain" else ["--run-dir", str(run_dir)]
    launch += [a for s in sets for a in ("--set", s)]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
        __file__, "--as-entry", prefix, mode, *launch, str(SCRIPT), "--steps", str(steps),
        "--step-times", prefix, *(["--cuda"] if cuda else []),
    ]  # fmt: skip
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    env.update(extra_env or {})
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    result = {
        "mode": mode,
        "sets": sets,
        "rc": done.returncode,
        "wall_s": round(time.monotonic() - began, 1),
    }
    if done.returncode != 0:
        result["stderr"] = done.stderr[-3000:]
        return result
    anomalies: list[dict] = []
    if mode != "plain":
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))  # run as a file: the repository is not on the path
        from bench.report_child import report_json

        anomalies = report_json(run_dir, env).get("anomalies", [])
    result.update(analyse(prefix, [a["step"] for a in anomalies]))
    result["anomalies"] = [
        [a["step"], a["ratio"], a["verdict"].get("cause"), a["verdict"].get("phase")]
        for a in anomalies
    ]
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--as-entry":
        _entry()
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2500)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--variants", default='{"distanom": []}',
        help='JSON {"name": {"sets": ["key=value", ...], "env": {...}}} run under distanom, '
        "besides plain torchrun",
    )  # fmt: skip
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU (a smoke run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    variants = {
        name: v if isinstance(v, dict) else {"sets": v}
        for name, v in json.loads(args.variants).items()
    }
    jobs: list[dict] = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.runs):
            order = [("plain", {}), *variants.items()]
            for name, spec in order if index % 2 == 0 else reversed(order):
                mode = "plain" if name == "plain" else "distanom"
                job = one_job(
                    mode, args.steps, Path(scratch), list(spec.get("sets", [])),
                    cuda=not args.cpu, extra_env=dict(spec.get("env", {})),
                )  # fmt: skip
                job["variant"] = name
                jobs.append(job)
                print(
                    json.dumps(
                        {
                            k: v
                            for k, v in job.items()
                            if k not in ("activities", "over_3x_detail", "anomaly_detail")
                        }
                    ),
                    flush=True,
                )
    try:
        import torch

        device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        version = torch.__version__
    except Exception:
        device, version = "unknown", "unknown"
    Path(args.out).write_text(
        json.dumps(
            {"bench": "stall_map", "device": device, "torch": version, "jobs": jobs}, indent=1
        )
    )


if __name__ == "__main__":
    main()
