"""What tracing costs: distanom's cupti backend against its alternatives, on one NVIDIA GPU.

    python3 bench/overhead.py                       # both workloads, all variants, 5 pairs
    python3 bench/overhead.py --workload resnet18 --pairs 7 --variants cupti,raw_cupti

Self-contained device benchmark. Each run of a variant is its own process (forked from
a server that has imported torch but never touched CUDA), so no CUPTI or profiler state
is shared. Runs come in pairs, (none, X) back to back, and the variants take turns
within each round of pairs, so slow drifts of the machine hit both sides of a pair.
The ratio X / none of each pair's wall time per step is reported, and the median ratio.

Workloads:
- resnet18: torchvision ResNet18, bf16, batch 5, SGD (the seed's; ~400 kernels in ~9 ms:
  launch-bound, the worst case for per-kernel tracing costs);
- transformer: nn.TransformerEncoder, 24 layers, d 1024, 16 heads, seq 2048, batch 10,
  bf16, AdamW (GPU-bound, >= 100 ms a step on an H200).

Variants and their step semantics (wall time per step = (end - start) / steps over the
timed loop, with one torch.cuda.synchronize() after the loop unless said otherwise):
- none: the training step alone.
- cupti: distanom's CuptiTracer, always on: mark_step after every step (one marker
  kernel), records kept raw. After the timed loop, untimed, 20 more steps with
  torch.cuda._sleep(20_000_000) injected into 3 known steps; each injected step and its
  neighbours are fetched with step_trace to check the sleep landed in its own step only.
  Then, also untimed by the pair, an in-process A/B: ab_pairs pairs of windows
  (governor_window steps each) with tracing on and off (CUPTI detached), in alternating
  order; each switch happens on one untimed step before its window, and each window is
  timed between two synchronizes. Free of the process-to-process spread that dominates
  the pairs on a noisy machine, its median on/off ratio is reported as `ab_ratio`.
- cupti_budget1: CuptiTracer driven by the OverheadGovernor with a 1% budget; the
  governor is fed each step's host time (time between two step ends; without a per-step
  synchronize this is the GPU-paced step time in steady state) and switches tracing per
  window (8 steps for resnet18, 2 for transformer, lag 2 windows' worth of data); its
  pairs run BUDGET_STEPS_FACTOR times the steps so the duty cycle settles. The step
  after a switch is flagged after-flush when the tracer detached at that boundary, as
  the agent flags it. Then, untimed by the pair, in-process budget blocks: block_pairs
  pairs of blocks, in alternating order, of block_steps steps governed by the budget
  (the same governor goes on from block to block) or with tracing off (CUPTI detached,
  the governor paused). A governed block runs on past block_steps until tracing is off
  and the step after the last switch has run, so every attach, detach and switch step
  falls inside governed blocks. Each block is timed between two synchronizes; blocks
  are short (64 steps on ResNet18) because the step time drifts by +-15% over seconds
  on the device, and only neighbouring blocks see the same drift. The
  budget's measured cost is `budget_overhead_pct` = (governed ms per step) / (off ms
  per step) - 1 over all blocks; `coverage` is the share of governed steps traced.
- raw_cupti: control. CUPTI activity buffers registered through distanom's binding,
  KERNEL+MEMCPY+MEMSET enabled, no markers, nothing decoded (records counted after the
  loop, untimed).
- kineto: distanom's portable backend (KinetoTracer: torch.profiler CUDA-only in cycles
  of kineto_window_steps=4 steps, each cycle flushed and kept unexported), mark_step
  after every step.
- kineto_always: torch.profiler, CUDA activities only, started before the warm-up and
  never flushed nor stopped (the process exits without stopping it: stopping 100k
  events costs seconds and is not part of the steady-state cost).
- seed: the seed recipe: torch.profiler CUDA-only, schedule(wait=0, warmup=0, active=1),
  on_trace_ready discarding the trace, and, as the seed does, torch.cuda.synchronize()
  and prof.step() after every step. Its partner `none` run does not synchronize per
  step, so its ratio is the cost of the whole recipe (sync + flush per step).

Output: bench/results/overhead_<workload>.json (see `_summary`), rewritten after every
pair, and progress on stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = ("cupti", "cupti_budget1", "raw_cupti", "kineto", "kineto_always", "seed")
# run on request (--variants): the per-step markers alone, without CUPTI
CONTROL_VARIANTS = ("markers_only",)
# cupti_budget1 pairs run this many times the steps: the governor settles over windows
BUDGET_STEPS_FACTOR = 6
WORKLOADS: dict[str, dict[str, int]] = {
    # steps/warmup sized so both workloads, 5 pairs of all variants, fit in ~8 minutes
    "resnet18": {"steps": 150, "warmup": 20, "governor_window": 8, "ab_pairs": 12,
                 "block_steps": 64, "block_pairs": 64},
    "transformer": {"steps": 12, "warmup": 3, "governor_window": 2, "ab_pairs": 6,
                    "block_steps": 32, "block_pairs": 3},
}  # fmt: skip
INJECT_CYCLES = 20_000_000
INJECT_OFFSETS = (5, 10, 15)
INJECT_PHASE_STEPS = 20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------
# Child side: one variant, one process


@dataclass
class Workload:
    step: Callable[[int], None]  # step(sleep_cycles)
    describe: dict[str, Any]


def build_workload(name: str, transformer_batch: int) -> Workload:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    if name == "resnet18":
        import torchvision

        with torch.device("cuda"):
            model = torchvision.models.resnet18().to(bf16)
        opt: Any = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(5, 3, 224, 224, device="cuda", dtype=bf16)
        y = torch.randn(5, 1000, device="cuda", dtype=bf16)
        desc = {"model": "torchvision resnet18", "dtype": "bf16", "batch": 5, "optimizer": "SGD"}
    elif name == "transformer":
        layer_kw = {"d_model": 1024, "nhead": 16, "dim_feedforward": 4096, "dropout": 0.0}
        with torch.device("cuda"):
            layer = torch.nn.TransformerEncoderLayer(**layer_kw, batch_first=True, norm_first=True)
            model = torch.nn.TransformerEncoder(layer, 24, enable_nested_tensor=False).to(bf16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(transformer_batch, 2048, 1024, device="cuda", dtype=bf16)
        y = torch.zeros_like(x)
        desc = {
            "model": "nn.TransformerEncoder", "layers": 24, "d_model": 1024, "heads": 16,
            "seq": 2048, "batch": transformer_batch, "dtype": "bf16", "optimizer": "AdamW",
        }  # fmt: skip
    else:
        raise ValueError(f"unknown workload {name}")

    def step(sleep_cycles: int = 0) -> None:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = F.mse_loss(out, y)
        loss.backward()
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        opt.step()

    return Workload(step, desc)


def _tracer_config(budget: float | None) -> Any:
    fields = {
        "backend": "cupti",
        "history_steps": 16,
        "ring_mb": 256,
        "overhead_budget_pct": budget,
        "kineto_window_steps": 4,
    }
    try:
        from distanom.config import TracerConfig

        return TracerConfig(**fields)
    except ImportError:  # the device image has no pydantic
        return SimpleNamespace(**fields)


def _timed(loop: Callable[[int], None], first: int, steps: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(first, first + steps):
        loop(i)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000.0 / steps


def _check_injected(tracer: Any, work: Workload, first: int) -> dict[str, Any]:
    """Untimed: 20 steps, 3 with a GPU sleep; fetch each and its neighbours."""
    import torch

    from distanom.tracers.base import Availability

    inject = {first + off for off in INJECT_OFFSETS}
    details: list[dict[str, Any]] = []

    def fetch(step: int) -> Any:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            state, why = tracer.explain(step)
            if state is Availability.READY:
                return tracer.step_trace(step)
            if state is Availability.GONE:
                return why
            time.sleep(0.005)
        return "still pending after 10 s"

    def spins(trace: Any) -> int:
        return sum(1 for e in trace.events if "spin_kernel" in e.get("name", ""))

    for i in range(first, first + INJECT_PHASE_STEPS):
        work.step(INJECT_CYCLES if i in inject else 0)
        tracer.mark_step(i, time.time_ns())
        s = i - 2
        if s in inject:
            torch.cuda.synchronize()
            got = {t: fetch(t) for t in (s - 1, s, s + 1)}
            ok_all = all(not isinstance(v, str) for v in got.values())
            detail: dict[str, Any] = {"step": s}
            if ok_all:
                counts = {t: spins(v) for t, v in got.items()}
                spin_ev = next(e for e in got[s].events if "spin_kernel" in e.get("name", ""))
                detail.update(
                    captured=counts[s] == 1 and counts[s - 1] == 0 and counts[s + 1] == 0,
                    spin_counts=[counts[s - 1], counts[s], counts[s + 1]],
                    spin_us=spin_ev["dur"] if counts[s] else None,
                    kernels=[got[t].stats["kernels"] for t in (s - 1, s, s + 1)],
                    stats=got[s].stats,
                )
            else:
                detail.update(
                    captured=False, unavailable={t: v for t, v in got.items() if isinstance(v, str)}
                )
            details.append(detail)
    return {
        "injected": len(inject),
        "captured_injected": sum(1 for d in details if d.get("captured")),
        "details": details,
    }


def _ab_windows(tracer: Any, work: Workload, first: int, window: int, pairs: int) -> dict[str, Any]:
    """Untimed by the pair: tracing on vs off (detached) in alternating windows."""
    on_ms: list[float] = []
    off_ms: list[float] = []
    ratios: list[float] = []
    step = first

    def traced_step(i: int) -> None:
        work.step(0)
        tracer.mark_step(i, time.time_ns())

    for p in range(pairs):
        got: dict[bool, float] = {}
        for on in (True, False) if p % 2 == 0 else (False, True):
            tracer.set_tracing(on)
            traced_step(step)  # the switch (attach, or synchronize + detach) happens here
            step += 1
            got[on] = _timed(traced_step, step, window)
            step += window
        on_ms.append(got[True])
        off_ms.append(got[False])
        ratios.append(got[True] / got[False])
    tracer.set_tracing(True)
    return {
        "pairs": pairs, "window_steps": window,
        "on_ms": [round(x, 4) for x in on_ms], "off_ms": [round(x, 4) for x in off_ms],
        "ratios": [round(x, 4) for x in ratios], "ab_ratio": round(statistics.median(ratios), 4),
    }  # fmt: skip


def _govern(tracer: Any, governor: Any, state: dict[str, Any], flushes_before: int) -> None:
    """Feed the step that just ended to the governor and switch for the next, as the
    agent does (`flushes_before`: the tracer's boundary_flushes before this boundary)."""
    now = time.perf_counter()
    g = state["g"]
    governor.record(g, now - state["last"], state["on"], state["after_flush"])
    state["last"] = now
    state["prev_on"] = state["on"]
    want = governor.tracing_on(g + 1)
    if want != tracer.tracing:
        tracer.set_tracing(want)
    state["on"] = tracer.tracing
    state["after_flush"] = tracer.boundary_flushes != flushes_before
    state["g"] = g + 1


def _budget_blocks(
    tracer: Any, governor: Any, work: Workload, first: int, state: dict[str, Any],
    block_steps: int, pairs: int, per_step: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """Untimed by the pair: governed blocks vs tracing-off blocks (see the docstring).
    per_step: also return every step's host time, to locate costs around the bursts."""
    import torch

    step = first
    # per step: [block number (governed even, off odd in pair order), traced, host ms]
    steps_ms: list[tuple[int, int, float]] = []
    blocks: dict[str, list[tuple[int, float]]] = {"governed": [], "off": []}
    traced_in_governed = 0
    switches_in_governed = 0
    if tracer.tracing:  # start from the state an off block needs
        tracer.set_tracing(False)

    for p in range(pairs):
        for kind in ("governed", "off") if p % 2 == 0 else ("off", "governed"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            n = 0
            block_no = 2 * p + (kind == "off")
            last = t0
            if kind == "off":
                for _ in range(block_steps):
                    work.step(0)
                    tracer.mark_step(step, time.time_ns())
                    step += 1
                    n += 1
                    if per_step:
                        now = time.perf_counter()
                        steps_ms.append((block_no, 0, round((now - last) * 1000.0, 3)))
                        last = now
            else:
                # resume the governor where it stopped; the step that follows an off
                # block starts with tracing off whatever the governor wants (it is
                # switched at the first boundary), as after any lagging decision
                state["last"] = t0
                state["on"] = tracer.tracing
                state["after_flush"] = False
                while n < block_steps or state["on"] or state["prev_on"]:
                    work.step(0)
                    flushes = tracer.boundary_flushes
                    tracer.mark_step(step, time.time_ns())
                    was_on = tracer.tracing
                    _govern(tracer, governor, state, flushes)
                    switches_in_governed += was_on and not state["on"]
                    traced_in_governed += bool(state["prev_on"])
                    step += 1
                    n += 1
                    if per_step:
                        ms = round((state["last"] - last) * 1000.0, 3)
                        steps_ms.append((block_no, int(state["prev_on"]), ms))
                        last = state["last"]
            torch.cuda.synchronize()
            blocks[kind].append((n, (time.perf_counter() - t0) * 1000.0))
    ms_per_step = {k: sum(ms for _, ms in v) / sum(n for n, _ in v) for k, v in blocks.items()}
    pair_ratios = [
        (g_ms / g_n) / (o_ms / o_n)
        for (g_n, g_ms), (o_n, o_ms) in zip(blocks["governed"], blocks["off"], strict=True)
    ]
    governed_steps = sum(n for n, _ in blocks["governed"])
    return {
        "block_steps": block_steps, "pairs": pairs,
        "governed": [[n, round(ms, 3)] for n, ms in blocks["governed"]],
        "off": [[n, round(ms, 3)] for n, ms in blocks["off"]],
        "governed_ms_per_step": round(ms_per_step["governed"], 4),
        "off_ms_per_step": round(ms_per_step["off"], 4),
        "budget_overhead_pct": round((ms_per_step["governed"] / ms_per_step["off"] - 1) * 100, 3),
        "pair_ratios": [round(r, 4) for r in pair_ratios],
        "coverage": round(traced_in_governed / governed_steps, 4),
        "traced_steps": traced_in_governed, "governed_steps": governed_steps,
        "switches_off": switches_in_governed,
        **({"steps_ms": steps_ms} if per_step else {}),
        "governor": governor.report(),
    }  # fmt: skip


def run_variant(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    variant, warmup, steps = spec["variant"], spec["warmup"], spec["steps"]
    work = build_workload(spec["workload"], spec["transformer_batch"])
    result: dict[str, Any] = {
        "variant": variant,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "workload_detail": work.describe,
    }
    work.step(0)  # first step: CUDA init, cuBLAS/cuDNN handles, allocator
    torch.cuda.synchronize()

    if variant == "none":
        for _ in range(warmup):
            work.step(0)
        result["wall_ms"] = _timed(lambda i: work.step(0), 0, steps)

    elif variant in ("cupti", "cupti_budget1"):
        from distanom.governor import GovernorParams, OverheadGovernor
        from distanom.tracers.cupti import CuptiTracer

        budget = 1.0 if variant == "cupti_budget1" else None
        tracer = CuptiTracer(_tracer_config(budget), rank=0)
        t0 = time.perf_counter()
        tracer.start()
        result["start_ms"] = (time.perf_counter() - t0) * 1000
        cal = tracer.calibration
        result["calibration"] = None if cal is None else {
            "grids": cal.grids, "block_work_size": cal.block_work_size,
            "clock_offset_ns": cal.clock_offset_ns, "memcpy_checked": cal.memcpy_checked,
            "cupti_version": cal.cupti_version, "library": cal.library,
        }  # fmt: skip
        governor = None
        # governor steps (g) count governed steps only; tracer steps never pause
        state: dict[str, Any] = {"on": True, "g": 1, "after_flush": False, "prev_on": True}
        if budget is not None:
            params = GovernorParams(window_steps=spec["governor_window"], lag_steps=2)
            governor = OverheadGovernor(budget, params, first_step=1)
            state["on"] = governor.tracing_on(1)
        tracer.mark_step(0, time.time_ns())
        tracer.set_tracing(state["on"])
        state["last"] = time.perf_counter()

        mark_ns: list[int] = []

        def traced_step(i: int) -> None:
            work.step(0)
            t_mark = time.perf_counter_ns()
            flushes = tracer.boundary_flushes
            tracer.mark_step(i, time.time_ns())
            if governor is not None:  # switches at this boundary, as the agent does
                _govern(tracer, governor, state, flushes)
            mark_ns.append(time.perf_counter_ns() - t_mark)

        for i in range(1, warmup + 1):
            traced_step(i)
        result["wall_ms"] = _timed(traced_step, warmup + 1, steps)
        timed_marks = sorted(mark_ns[warmup:])
        result["mark_step_us"] = {
            "median": timed_marks[len(timed_marks) // 2] / 1000,
            "mean": sum(timed_marks) / len(timed_marks) / 1000,
            "max": timed_marks[-1] / 1000,
        }
        if governor is not None:
            result["governor"] = governor.report()
            result["budget_blocks"] = _budget_blocks(
                tracer, governor, work, warmup + steps + 1, state,
                spec["block_steps"], spec["block_pairs"], spec.get("per_step", False),
            )  # fmt: skip
        else:
            first = warmup + steps + 1
            result["injection"] = _check_injected(tracer, work, first)
            first += INJECT_PHASE_STEPS
            result["ab"] = _ab_windows(
                tracer, work, first, spec["governor_window"], spec["ab_pairs"]
            )
        tracer.close()
        result["tracer_stats"] = tracer.stats()

    elif variant == "raw_cupti":
        from distanom.tracers.cupti.buffers import BufferPool
        from distanom.tracers.cupti.library import CuptiLib
        from distanom.tracers.cupti.session import ActivitySession

        lib = CuptiLib.load()
        session = ActivitySession(lib, BufferPool.for_ring(256))
        session.open()
        for _ in range(warmup):
            work.step(0)
        result["wall_ms"] = _timed(lambda i: work.step(0), 0, steps)
        session.flush(forced=True)
        records = sum(
            len(lib.record_offsets(b.address, b.valid_size)) for b in session.pool.completed()
        )
        result["records_per_step"] = records / (warmup + steps)
        result["cupti_dropped_records"] = session.poll_dropped()
        result["pool"] = session.pool.stats()
        session.close()

    elif variant == "markers_only":  # control: the cupti backend's per-step markers alone
        marker = torch.cuda.jiterator._create_jit_fn(
            "template <typename T> T distanom_step_marker(T x) { return x + T(1); }"
        )
        tensor = torch.zeros(1, device="cuda", dtype=torch.int32)
        events = [torch.cuda.Event() for _ in range(32)]

        def marked_step(i: int) -> None:
            work.step(0)
            marker(tensor)
            events[i % 32].record()
            events[(i + 20) % 32].query()

        for i in range(warmup):
            marked_step(i)
        result["wall_ms"] = _timed(marked_step, 0, steps)

    elif variant == "kineto":
        from distanom.tracers.kineto import KinetoTracer

        config = _tracer_config(None)
        tracer = KinetoTracer(config, use_cuda=True)  # distanom's portable backend
        tracer.mark_step(0, time.time_ns())
        tracer.start()

        def kineto_step(i: int) -> None:
            work.step(0)
            tracer.mark_step(i, time.time_ns())

        for i in range(1, warmup + 1):
            kineto_step(i)
        result["wall_ms"] = _timed(kineto_step, warmup + 1, steps)
        result["window_steps"] = getattr(config, "kineto_window_steps", None)

    elif variant == "kineto_always":
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()  # never stopped: see the module docstring
        for _ in range(warmup):
            work.step(0)
        result["wall_ms"] = _timed(lambda i: work.step(0), 0, steps)

    elif variant == "seed":
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(
            activities=[ProfilerActivity.CUDA],
            schedule=schedule(wait=0, warmup=0, active=1),
            on_trace_ready=lambda p: None,
        )
        prof.__enter__()

        def seed_step(i: int) -> None:
            work.step(0)
            torch.cuda.synchronize()
            prof.step()

        for i in range(warmup):
            seed_step(i)
        result["wall_ms"] = _timed(seed_step, 0, steps)
    else:
        raise ValueError(f"unknown variant {variant}")
    return result


def parse_cpus(text: str) -> list[int]:
    """CPU numbers from a list like "0-3,8": the cores every run is pinned to."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, _, last = part.partition("-")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"reversed range {part!r}")
        cpus.extend(range(low, high + 1))
    if not cpus:
        raise ValueError(f"no CPU in {text!r}")
    return cpus


def _child(spec: dict[str, Any], conn: Any) -> None:
    try:
        if spec.get("cpus"):
            # the same cores for both runs of a pair: a launch-bound step's speed depends
            # on where the scheduler puts the process (its core, its distance to the GPU)
            os.sched_setaffinity(0, spec["cpus"])
        conn.send(("ok", run_variant(spec)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no exit-time profiler stop, no CUDA teardown: not part of any cost


# ---------------------------------------------------------------------------------------
# Parent side


def run_once(ctx: Any, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(spec, child), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    child.close()
    status, payload = "error", f"no result within {timeout_s:.0f} s"
    if parent.poll(timeout_s):
        try:
            status, payload = parent.recv()
        except EOFError:
            payload = "child exited without a result"
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
    took = time.perf_counter() - t0
    if status != "ok":
        log(f"  {spec['variant']}: FAILED ({took:.1f} s)\n{payload}")
        return {"variant": spec["variant"], "error": payload, "process_s": took}
    payload["process_s"] = took
    return payload  # type: ignore[no-any-return]


def _summary(
    workload: str, runs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]], cfg: dict[str, Any]
) -> dict[str, Any]:
    first_ok = next(
        (r for pairs in runs.values() for pair in pairs for r in pair if "wall_ms" in r), {}
    )
    out: dict[str, Any] = {
        "device": first_ok.get("device"),
        "torch": first_ok.get("torch"),
        "cuda": first_ok.get("cuda"),
        "backend": "cupti",
        "workload": workload,
        "workload_detail": first_ok.get("workload_detail"),
        "config": cfg,
        "variants": {},
    }
    for variant, pairs in runs.items():
        ok = [(a, b) for a, b in pairs if "wall_ms" in a and "wall_ms" in b]
        ratios = [b["wall_ms"] / a["wall_ms"] for a, b in ok]
        entry: dict[str, Any] = {
            "pairs": [[round(a["wall_ms"], 4), round(b["wall_ms"], 4)] for a, b in ok],
            "ratios": [round(r, 4) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
            "failed_runs": [
                r.get("error", "")[-2000:] for pair in pairs for r in pair if "wall_ms" not in r
            ],
        }
        traced = [b for _, b in ok]
        if variant == "cupti":
            inj = [b["injection"] for b in traced if "injection" in b]
            entry["injected"] = sum(i["injected"] for i in inj)
            entry["captured_injected"] = sum(i["captured_injected"] for i in inj)
            entry["injection_details"] = [i["details"] for i in inj]
            entry["tracer_stats"] = [b.get("tracer_stats") for b in traced]
            entry["calibration"] = next((b.get("calibration") for b in traced), None)
            entry["start_ms"] = [round(b.get("start_ms", 0), 1) for b in traced]
            ab = [b["ab"]["ab_ratio"] for b in traced if "ab" in b]
            entry["ab_ratios"] = ab  # per process: in-process on/off window ratio
            entry["ab_ratio_median"] = round(statistics.median(ab), 4) if ab else None
            entry["ab"] = [b.get("ab") for b in traced]
            out["injected"] = entry["injected"]
            out["captured_injected"] = entry["captured_injected"]
        if variant == "cupti_budget1":
            entry["governor_reports"] = [b.get("governor") for b in traced]
            entry["tracer_stats"] = [b.get("tracer_stats") for b in traced]
            blocks = [b["budget_blocks"] for b in traced if "budget_blocks" in b]
            entry["budget_blocks"] = blocks
            if blocks:
                # all processes' blocks together: ms per step governed vs off
                gov = [x for blk in blocks for x in blk["governed"]]
                off = [x for blk in blocks for x in blk["off"]]
                g_ms = sum(ms for _, ms in gov) / sum(n for n, _ in gov)
                o_ms = sum(ms for _, ms in off) / sum(n for n, _ in off)
                entry["budget_overhead_pct"] = round((g_ms / o_ms - 1) * 100, 3)
                entry["budget_overhead_pct_per_process"] = [
                    blk["budget_overhead_pct"] for blk in blocks
                ]
                entry["coverage"] = round(
                    sum(blk["traced_steps"] for blk in blocks)
                    / sum(blk["governed_steps"] for blk in blocks), 4
                )  # fmt: skip
                out["budget_overhead_pct"] = entry["budget_overhead_pct"]
                out["budget_coverage"] = entry["coverage"]
            out["governor_report"] = entry["governor_reports"][-1] if traced else None
        if variant == "raw_cupti":
            entry["records_per_step"] = [b.get("records_per_step") for b in traced]
            entry["cupti_dropped_records"] = [b.get("cupti_dropped_records") for b in traced]
        out["variants"][variant] = entry
    return out


def bench_workload(
    ctx: Any, workload: str, args: argparse.Namespace, variants: Sequence[str]
) -> Path:
    defaults = WORKLOADS[workload]
    steps = args.steps or defaults["steps"]
    warmup = args.warmup if args.warmup is not None else defaults["warmup"]
    window = args.governor_window or defaults["governor_window"]
    cfg = {
        "pairs": args.pairs, "steps": steps, "warmup": warmup, "variants": list(variants),
        "governor_window": window, "transformer_batch": args.transformer_batch,
        "inject_cycles": INJECT_CYCLES, "isolation": "forkserver process per run",
        "cpus": args.cpus or "any",
    }  # fmt: skip
    out_path = Path(args.out) / f"overhead_{workload}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {v: [] for v in variants}
    t_start = time.perf_counter()
    for p in range(args.pairs):
        order = list(variants[p % len(variants) :]) + list(variants[: p % len(variants)])
        for variant in order:
            # the governor needs many windows to settle: its pairs run longer
            n = steps * (BUDGET_STEPS_FACTOR if variant == "cupti_budget1" else 1)
            base = {"workload": workload, "steps": n, "warmup": warmup,
                    "governor_window": window,
                    "ab_pairs": defaults["ab_pairs"],
                    "block_steps": args.block_steps or defaults["block_steps"],
                    "per_step": args.per_step,
                    "block_pairs": (args.block_pairs if args.block_pairs is not None
                                    else defaults["block_pairs"]),
                    "transformer_batch": args.transformer_batch,
                    "cpus": args.cpu_list}  # fmt: skip
            a = run_once(ctx, {**base, "variant": "none"}, args.child_timeout)
            b = run_once(ctx, {**base, "variant": variant}, args.child_timeout)
            runs[variant].append((a, b))
            if "wall_ms" in a and "wall_ms" in b:
                extra = ""
                if "injection" in b:
                    inj = b["injection"]
                    extra = f"  injected captured {inj['captured_injected']}/{inj['injected']}"
                    if "ab" in b:
                        extra += f"  in-process on/off {b['ab']['ab_ratio']}"
                if "governor" in b:
                    g = b["governor"]
                    extra = (
                        f"  governor traced {g['traced_fraction']}, "
                        f"overhead {g['measured_overhead_pct']}"
                    )
                if "budget_blocks" in b:
                    blk = b["budget_blocks"]
                    extra += (
                        f"  blocks: governed/off {blk['budget_overhead_pct']:+.2f}% "
                        f"coverage {blk['coverage']}"
                    )
                log(
                    f"{workload} pair {p + 1}/{args.pairs} {variant:14s} "
                    f"none {a['wall_ms']:8.3f} ms  {variant} {b['wall_ms']:8.3f} ms  "
                    f"ratio {b['wall_ms'] / a['wall_ms']:.3f}  "
                    f"({a['process_s']:.1f}+{b['process_s']:.1f} s){extra}"
                )
            out_path.write_text(json.dumps(_summary(workload, runs, cfg), indent=1))
        log(f"{workload}: round {p + 1} done, {time.perf_counter() - t_start:.0f} s elapsed")
    summary = _summary(workload, runs, cfg)
    summary["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    out_path.write_text(json.dumps(summary, indent=1))
    for variant, entry in summary["variants"].items():
        log(f"{workload} {variant:14s} median ratio {entry['median_ratio']}  {entry['ratios']}")
    none_ms = [pair[0] for e in summary["variants"].values() for pair in e["pairs"]]
    if none_ms:
        log(f"{workload}: untraced step {statistics.median(none_ms):.2f} ms (median over runs)")
    if "budget_overhead_pct" in summary:
        log(
            f"{workload}: 1% budget, in-process blocks: governed vs off "
            f"{summary['budget_overhead_pct']:+.3f}%, coverage {summary['budget_coverage']}"
        )
    if "captured_injected" in summary:
        got, want = summary["captured_injected"], summary["injected"]
        log(f"{workload}: injected sleeps captured {got}/{want}")
    log(f"wrote {out_path}")
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    parser.add_argument("--pairs", type=int, default=5, help="(none, X) pairs per variant")
    parser.add_argument(
        "--steps", type=int, default=0, help="timed steps (0: per-workload default)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps (default per workload)"
    )
    parser.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of " + ",".join(VARIANTS),
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    parser.add_argument("--transformer-batch", type=int, default=10)
    parser.add_argument(
        "--governor-window",
        type=int,
        default=0,
        help="steps per duty-cycle window for cupti_budget1 and the in-process A/B "
        "(0: per-workload default; the agent's own default is 16)",
    )
    parser.add_argument(
        "--block-steps",
        type=int,
        default=0,
        help="cupti_budget1: steps per in-process budget block (0: per-workload default)",
    )
    parser.add_argument(
        "--block-pairs",
        type=int,
        default=None,
        help="cupti_budget1: (governed, off) block pairs per process (default per workload)",
    )
    parser.add_argument(
        "--per-step",
        action="store_true",
        help="cupti_budget1: keep every block step's host time in the result",
    )
    parser.add_argument("--child-timeout", type=float, default=300.0)
    parser.add_argument(
        "--cpus",
        default="",
        help='pin every run to these cores, e.g. "0-3" (default: wherever the OS puts it)',
    )
    args = parser.parse_args(argv)
    args.cpu_list = None
    if args.cpus:
        try:
            args.cpu_list = parse_cpus(args.cpus)
        except ValueError:
            parser.error(f"--cpus: not a CPU list: {args.cpus!r}")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in (*VARIANTS, *CONTROL_VARIANTS)]
    if unknown or not variants:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.pairs < 1:
        parser.error("--pairs must be >= 1")
    ctx = mp.get_context("forkserver")
    # The server imports torch once; every run forks from it and initialises CUDA itself.
    ctx.set_forkserver_preload(["torch", "torchvision", "numpy"])
    workloads = list(WORKLOADS) if args.workload == "all" else [args.workload]
    t0 = time.perf_counter()
    for workload in workloads:
        bench_workload(ctx, workload, args, variants)
    log(f"all done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
