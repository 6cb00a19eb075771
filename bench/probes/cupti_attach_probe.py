"""Where does CUPTI's per-step cost come from while tracing is switched off?

    python3 bench/probes/cupti_attach_probe.py --rounds 6 --out "$OUT"

Device probe for the overhead governor (issue 4). On the launch-bound ResNet18 step
(bf16, batch 5, ~400 kernels in ~9 ms), the 1% budget measured 1.14x although the
governor traced only 14-20% of the windows, and its untraced windows ran ~12% slower
than a process that never attached CUPTI. Hypothesis: CUPTI's per-launch cost stays while
CUPTI is attached, even with every activity kind disabled. This probe measures that
directly, each variant in its own forked process, interleaved in rounds:

- none:            no CUPTI at all;
- enabled:         KERNEL+MEMCPY+MEMSET enabled for the timed loop (the raw floor);
- enabled_devbuf:  same, CUPTI's device buffer set to 32 MB before enabling;
- registered_only: buffer callbacks registered, no kind ever enabled;
- disabled:        enabled through the warm-up, then every kind disabled and flushed;
- finalized:       as `disabled`, then cuptiFinalize() (CUPTI detached) before the loop;
- reattached:      as `finalized`, then re-registered and re-enabled: records must flow
                   again, at the `enabled` cost;
- cycle:           in one process, windows of 8 steps alternating attached+enabled and
                   detached, switching with disable+flush+finalize and register+enable;
                   per-window step times, switch costs and records per window.

Wall time per step = (end - start) / steps with one synchronize at each end.
Writes cupti_attach_probe.json under --out, progress on stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VARIANTS = (
    "enabled", "enabled_devbuf", "registered_only", "disabled", "finalized", "reattached",
)  # fmt: skip
STEPS, WARMUP, WINDOW, CYCLE_WINDOWS = 150, 20, 8, 24
ATTR_DEVICE_BUFFER_SIZE = 0  # CUpti_ActivityAttribute (cupti_activity.h)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_step() -> Any:
    import torch
    import torch.nn.functional as F
    import torchvision

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = torchvision.models.resnet18().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(5, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(5, 1000, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    return step


def timed(step: Any, n: int) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1000.0 / n


class Cupti:
    """distanom's binding plus the two calls this probe needs beyond it."""

    def __init__(self) -> None:
        from distanom.tracers.cupti import library as cupti_lib
        from distanom.tracers.cupti.buffers import BufferPool
        from distanom.tracers.cupti.session import ActivitySession

        self.mod = cupti_lib
        self.lib = cupti_lib.CuptiLib.load()
        dll = self.lib._dll
        self._finalize = dll.cuptiFinalize
        self._finalize.restype = ctypes.c_int
        self._finalize.argtypes = []
        self._set_attr = dll.cuptiActivitySetAttribute
        self._set_attr.restype = ctypes.c_int
        self._set_attr.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
        self.session = ActivitySession(self.lib, BufferPool.for_ring(256))

    def open(self) -> None:
        self.session.open()

    def set_device_buffer(self, size: int) -> int:
        value = ctypes.c_size_t(size)
        nbytes = ctypes.c_size_t(ctypes.sizeof(value))
        return int(
            self._set_attr(ATTR_DEVICE_BUFFER_SIZE, ctypes.byref(nbytes), ctypes.byref(value))
        )

    def detach(self) -> tuple[float, int]:
        import torch

        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self.session.disable()
        self.session.flush(forced=True)
        rc = int(self._finalize())
        return (time.perf_counter() - t0) * 1000, rc

    def attach(self) -> float:
        t0 = time.perf_counter()
        self.lib.register_callbacks()
        self.session.enable()
        return (time.perf_counter() - t0) * 1000

    def records(self) -> int:
        self.session.flush(forced=True)
        return sum(
            len(self.lib.record_offsets(b.address, b.valid_size))
            for b in self.session.pool.completed()
        )


def run_variant(variant: str) -> dict[str, Any]:
    import torch

    step = build_step()
    step()
    torch.cuda.synchronize()
    out: dict[str, Any] = {"variant": variant, "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "cuda": torch.version.cuda}  # fmt: skip
    if variant == "none":
        timed(step, WARMUP)
        out["wall_ms"] = timed(step, STEPS)
        return out
    cu = Cupti()
    out["cupti_version"] = cu.lib.version()
    if variant == "registered_only":
        cu.lib.register_callbacks()
        timed(step, WARMUP)
        out["wall_ms"] = timed(step, STEPS)
        return out
    if variant == "enabled_devbuf":
        out["set_attr_rc"] = cu.set_device_buffer(32 << 20)
    cu.open()
    timed(step, WARMUP)
    if variant in ("enabled", "enabled_devbuf"):
        out["wall_ms"] = timed(step, STEPS)
        out["records_per_step"] = cu.records() / (WARMUP + STEPS)
        return out
    if variant == "disabled":
        torch.cuda.synchronize()
        cu.session.disable()
        cu.session.flush(forced=True)
        before = cu.records()
        out["wall_ms"] = timed(step, STEPS)
        out["records_while_disabled"] = cu.records() - before
        return out
    detach_ms, rc = cu.detach()
    out.update(detach_ms=detach_ms, finalize_rc=rc)
    if variant == "finalized":
        out["wall_ms"] = timed(step, STEPS)
        return out
    if variant == "reattached":
        timed(step, WARMUP)
        before = cu.records()
        out["attach_ms"] = cu.attach()
        timed(step, WARMUP)
        out["wall_ms"] = timed(step, STEPS)
        out["records_per_step"] = (cu.records() - before) / (WARMUP + STEPS)
        return out
    raise ValueError(variant)


def run_cycle() -> dict[str, Any]:
    """Alternate attached+enabled and detached windows in one process."""
    import torch

    step = build_step()
    step()
    torch.cuda.synchronize()
    cu = Cupti()
    cu.open()
    timed(step, WARMUP)
    windows: list[dict[str, Any]] = []
    attached = True
    counted = cu.records()
    for w in range(CYCLE_WINDOWS):
        ms = timed(step, WINDOW)
        entry: dict[str, Any] = {"window": w, "attached": attached, "step_ms": ms}
        if attached:
            now = cu.records()
            entry["records"] = now - counted
            detach_ms, rc = cu.detach()
            counted = cu.records()
            entry.update(switch_ms=detach_ms, finalize_rc=rc)
        else:
            entry["switch_ms"] = cu.attach()
        windows.append(entry)
        attached = not attached
    on = [w["step_ms"] for w in windows if w["attached"]]
    off = [w["step_ms"] for w in windows if not w["attached"]]
    return {
        "variant": "cycle", "window_steps": WINDOW, "windows": windows,
        "attached_median_ms": statistics.median(on), "detached_median_ms": statistics.median(off),
        "ratio_attached_over_detached": statistics.median(on) / statistics.median(off),
        "detach_ms_median": statistics.median(w["switch_ms"] for w in windows if w["attached"]),
        "attach_ms_median": statistics.median(w["switch_ms"] for w in windows if not w["attached"]),
        "records_per_attached_window": [w.get("records") for w in windows if w["attached"]],
    }  # fmt: skip


def child(variant: str, conn: Any) -> None:
    try:
        conn.send(("ok", run_cycle() if variant == "cycle" else run_variant(variant)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        sys.stdout.flush()
        os._exit(0)


def run_once(ctx: Any, variant: str) -> dict[str, Any]:
    parent, conn = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child, args=(variant, conn), daemon=True)
    t0 = time.perf_counter()
    proc.start()
    conn.close()
    status, payload = "error", "no result within 120 s"
    if parent.poll(120):
        try:
            status, payload = parent.recv()
        except EOFError:
            payload = "child exited without a result (crashed?)"
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    if status != "ok":
        log(f"{variant}: FAILED\n{payload}")
        return {"variant": variant, "error": str(payload)[-3000:]}
    payload["process_s"] = round(time.perf_counter() - t0, 1)
    return payload  # type: ignore[no-any-return]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cycles", type=int, default=2, help="cycle processes")
    parser.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = parser.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torchvision", "numpy"])
    runs: list[dict[str, Any]] = []
    out_path = Path(args.out) / "cupti_attach_probe.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # the in-process cycle first: its answer matters most if the call runs out of time
    cycles = [run_once(ctx, "cycle") for _ in range(args.cycles)]
    for c in cycles:
        log(f"cycle: {json.dumps({k: v for k, v in c.items() if k != 'windows'})}")
    for r in range(args.rounds):
        order = list(VARIANTS[r % len(VARIANTS) :]) + list(VARIANTS[: r % len(VARIANTS)])
        for variant in order:
            a, b = run_once(ctx, "none"), run_once(ctx, variant)
            ratio = b["wall_ms"] / a["wall_ms"] if "wall_ms" in a and "wall_ms" in b else None
            runs.append({"round": r, "variant": variant, "none": a, "traced": b, "ratio": ratio})
            log(f"round {r} {variant:16s} none {a.get('wall_ms', 0):7.3f}  "
                f"{variant} {b.get('wall_ms', 0):7.3f}  ratio {ratio}")  # fmt: skip
            out_path.write_text(json.dumps({"cycles": cycles, "runs": runs}, indent=1))
    summary: dict[str, Any] = {"steps": STEPS, "warmup": WARMUP, "medians": {}}
    for variant in VARIANTS:
        ratios = [x["ratio"] for x in runs if x["variant"] == variant and x["ratio"]]
        summary["medians"][variant] = {
            "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
            "ratios": [round(x, 4) for x in ratios],
        }
        log(f"{variant:16s} median {summary['medians'][variant]['median_ratio']}  {ratios}")
    first = next((x["none"] for x in runs if "device" in x["none"]), {})
    summary.update(device=first.get("device"), torch=first.get("torch"), cuda=first.get("cuda"))
    out_path.write_text(json.dumps({"summary": summary, "cycles": cycles, "runs": runs}, indent=1))
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
