"""Could a timestamp kernel time steps for less than a CUDA event? A probe, not product.

    python3 bench/probes/stamp_kernel_probe.py --out $OUT/stamp_kernel.json [--steps 400]

On the H200 VM a CUDA event recorded at a step boundary costs the training thread 50-80
us of CPU (bench/results/event_clock_probe_h200.json,
bench/results/boundary_probe_h200_c60ff5f.json). The alternative probed here: at each
boundary launch a one-thread kernel (PTX, loaded through the driver API with ctypes, as
the cupti step marker is) that stores the GPU's `%globaltimer` (ns) into a slot of
host memory mapped into the device (`cuMemHostAlloc(DEVICEMAP)`). A step's GPU time is
then the difference of two slots, read from host memory: no driver call to read it,
and a slot still zero is a boundary the GPU has not passed.

Blocks of the seed's ResNet18 loop (one kind per block, rotating, `--repeats` times):
`events` (record a timing event per step on a cached stream), `stamps` (launch the
stamp kernel per step), `both` (stamp, then event, every step: the two clocks' step
times compared). Per block: ms per step and the per-call wall / thread-CPU microseconds
of what the boundary does; for `both`, how far the stamp durations are from the event
durations (median and max absolute difference, share within 20 us).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "workloads"))

from loops import build_loop  # noqa: E402

STAMP_PTX = """
.version 7.0
.target sm_70
.address_size 64

.visible .entry distanom_step_stamp(.param .u64 slot)
{
    .reg .b64 %rd<3>;
    ld.param.u64 %rd1, [slot];
    mov.u64 %rd2, %globaltimer;
    st.volatile.global.u64 [%rd1], %rd2;
    membar.sys;
    ret;
}
"""
CU_MEMHOSTALLOC_DEVICEMAP = 0x02


class StampKernel:
    """The stamp kernel and its slots (`slots` uint64 in mapped host memory)."""

    def __init__(self, slots: int) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp = ctypes.c_void_p
        self._launch = lib.cuLaunchKernel
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [vp] + [ctypes.c_uint] * 7 + [vp, vp, vp]
        module, function = vp(), vp()
        self._check(lib.cuModuleLoadData(ctypes.byref(module), STAMP_PTX.encode()), "load")
        self._check(
            lib.cuModuleGetFunction(ctypes.byref(function), module, b"distanom_step_stamp"),
            "function",
        )
        self._function = function
        host = vp()
        self._check(
            lib.cuMemHostAlloc(ctypes.byref(host), ctypes.c_size_t(8 * slots),
                               ctypes.c_uint(CU_MEMHOSTALLOC_DEVICEMAP)),
            "cuMemHostAlloc",
        )  # fmt: skip
        device = ctypes.c_uint64()
        self._check(
            lib.cuMemHostGetDevicePointer_v2(ctypes.byref(device), host, ctypes.c_uint(0)),
            "cuMemHostGetDevicePointer",
        )
        self.slots = (ctypes.c_uint64 * slots).from_address(host.value or 0)
        ctypes.memset(host, 0, 8 * slots)
        self._device = device.value
        self._count = slots
        self._arg = ctypes.c_uint64(0)
        self._params = (vp * 1)(ctypes.cast(ctypes.pointer(self._arg), vp))
        self._stream: int | None = None

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA driver error {rc}")

    def stamp(self, index: int) -> None:
        if self._stream is None:
            self._stream = torch.cuda.current_stream().cuda_stream
        self._arg.value = self._device + 8 * (index % self._count)
        rc = self._launch(self._function, 1, 1, 1, 1, 1, 1, 0, self._stream, self._params, None)
        if rc:
            self._check(rc, "cuLaunchKernel")


def block(kind: str, loop: Any, steps: int, stamps: StampKernel) -> dict[str, Any]:
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps)]
    stream = torch.cuda.current_stream()
    ctypes.memset(ctypes.addressof(stamps.slots), 0, 8 * stamps._count)
    walls: list[int] = []
    cpus: list[int] = []
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(steps):
        loop.step()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        if kind in ("stamps", "both"):
            stamps.stamp(i)
        if kind in ("events", "both"):
            events[i].record(stream)
        cpus.append(time.thread_time_ns() - cpu)
        walls.append(time.perf_counter_ns() - wall)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - started) * 1000 / steps
    record: dict[str, Any] = {
        "kind": kind,
        "ms_per_step": round(ms, 4),
        "wall_us_median": round(statistics.median(walls) / 1e3, 2),
        "cpu_us_median": round(statistics.median(cpus) / 1e3, 2),
        "cpu_us_mean": round(statistics.fmean(cpus) / 1e3, 2),
    }
    if kind in ("stamps", "both"):
        values = list(stamps.slots[:steps])
        record["stamps_written"] = sum(1 for v in values if v)
        began = time.perf_counter_ns()
        _ = list(stamps.slots[:steps])
        record["read_all_slots_us"] = round((time.perf_counter_ns() - began) / 1e3, 2)
        if kind == "both":
            diffs = []
            for i in range(1, steps):
                event_ms = events[i - 1].elapsed_time(events[i])
                stamp_ms = (values[i] - values[i - 1]) / 1e6
                diffs.append(abs(event_ms - stamp_ms) * 1e3)  # us
            record["stamp_vs_event_abs_diff_us"] = {
                "median": round(statistics.median(diffs), 2),
                "max": round(max(diffs), 2),
                "within_20us": round(sum(d <= 20 for d in diffs) / len(diffs), 4),
            }
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    loop = build_loop("resnet18", "cuda:0", small=False)
    for _ in range(50):
        loop.step()
    out: dict[str, Any] = {
        "facts": {
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0),
            "python": platform.python_version(),
        },
        "blocks": [],
    }
    try:
        stamps = StampKernel(args.steps)
    except Exception as err:
        out["error"] = f"{type(err).__name__}: {err}"
        args.out.write_text(json.dumps(out, indent=1) + "\n")
        print(out["error"])
        return 1
    for _ in range(args.repeats):
        for kind in ("events", "stamps", "both"):
            out["blocks"].append(block(kind, loop, args.steps, stamps))
            print(json.dumps(out["blocks"][-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
