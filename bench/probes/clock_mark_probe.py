"""Bisect what a step clock's mark costs on the training thread (seed ResNet18 loop).

    python3 bench/probes/clock_mark_probe.py [--steps 300] [--repeats 2]

On the H200 VM a bare `Event.record(stream)` on a cached stream cost 11-30 us of CPU
right after a step, c60ff5f's record-only `StepClock.mark` 64-83 us
(bench/results/clock_mark_probe_h200.json), and the clock of cfb7e3e (`record()` with
`current_stream()`, then `query()` and `elapsed_time()` every step) 63-96 us. Each block
times one way of marking a step right after it (thread CPU time and wall time per call,
medians):

- `noop`: nothing (the floor of the two clock reads);
- `bare_pool8`: `Event.record(stream)` on 8 pooled events, stream cached;
- `c_record`: `torch._C._CudaEventBase.record(event, stream)`, no Python wrapper;
- `stream_key`: `torch._C._cuda_getCurrentStream(torch._C._cuda_getDevice())`;
- `current_stream`: `torch.cuda.current_stream()`;
- `query_old`: `query()` of an event recorded 4 steps before;
- `elapsed_old`: `elapsed_time()` between two events recorded 5 and 4 steps before;
- `c60ff5f_mark`: c60ff5f's record-only mark (bench/probes/_clock_c60ff5f.py), its
  `poll()` every 32 steps (untimed);
- `cfb7e3e_mark`: the clock of cfb7e3e (bench/probes/_clock_cfb7e3e.py);
- `clock_mark`: distanom.clock.StepClock.mark as it is (C-level calls, stream read as a
  tuple, one poll every 4 steps);
- the same calls through the CUDA driver API by ctypes, as the cupti tracer's marker
  already launches its kernel (the next step considered for the clock, not yet used):
  `raw_stream` (`torch._C._cuda_getCurrentRawStream(device)`: the current stream as one
  int), `drv_record` (`cuEventRecord` on it), `drv_query_old` (`cuEventQuery`),
  `drv_elapsed_old` (`cuEventElapsedTime`), and `drv_mark` (all of it as a clock would:
  raw stream, record, and every 4 steps a query and 4 elapsed times).
  `drv_agrees`: the largest difference between `cuEventElapsedTime` and torch's
  `elapsed_time` over the same event pairs (ms), and how many pairs were compared.
Prints one JSON line per block; `--out FILE` also writes them as a JSON list.
"""

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "workloads"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _clock_c60ff5f import StepClock as C60Clock
from _clock_cfb7e3e import StepClock as CfbClock
from loops import build_loop

from distanom.clock import StepClock

KINDS = [
    "noop",
    "bare_pool8",
    "c_record",
    "stream_key",
    "current_stream",
    "query_old",
    "elapsed_old",
    "c60ff5f_mark",
    "cfb7e3e_mark",
    "clock_mark",
    "raw_stream",
    "drv_record",
    "drv_query_old",
    "drv_elapsed_old",
    "drv_mark",
]
CUDA_SUCCESS = 0


class DriverEvents:
    """cuEventRecord / cuEventQuery / cuEventElapsedTime on torch's events, by ctypes."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        c_void_p, c_int = ctypes.c_void_p, ctypes.c_int
        self._record = lib.cuEventRecord
        self._record.argtypes, self._record.restype = [c_void_p, c_void_p], c_int
        self._query = lib.cuEventQuery
        self._query.argtypes, self._query.restype = [c_void_p], c_int
        self._elapsed = lib.cuEventElapsedTime
        self._elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), c_void_p, c_void_p]
        self._elapsed.restype = c_int
        self._out = ctypes.c_float()
        self._out_ref = ctypes.byref(self._out)

    def record(self, event: int, stream: int) -> None:
        code = self._record(event, stream)
        if code != CUDA_SUCCESS:
            raise RuntimeError(f"cuEventRecord: {code}")

    def query(self, event: int) -> bool:
        return bool(self._query(event) == CUDA_SUCCESS)

    def elapsed_ms(self, start: int, end: int) -> float:
        code = self._elapsed(self._out_ref, start, end)
        if code != CUDA_SUCCESS:
            raise RuntimeError(f"cuEventElapsedTime: {code}")
        return float(self._out.value)


def created_handles(events: list[torch.cuda.Event]) -> list[int]:
    """The driver handles of torch events (torch creates an event at its first record,
    so each is recorded once first: a handle read before that is 0, invalid)."""
    for event in events:
        event.record()
    torch.cuda.synchronize()
    return [int(event.cuda_event) for event in events]


def driver_agreement(loop: object, steps: int) -> dict[str, object]:
    """Durations by the driver API against torch's elapsed_time, same event pairs."""
    drv = DriverEvents()
    raw = torch._C._cuda_getCurrentRawStream
    device = torch.cuda.current_device()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    handles = created_handles(events)
    drv.record(handles[0], raw(device))
    for i in range(steps):
        loop.step()  # type: ignore[attr-defined]
        drv.record(handles[i + 1], raw(device))
    torch.cuda.synchronize()
    worst = max(
        abs(drv.elapsed_ms(handles[i], handles[i + 1]) - events[i].elapsed_time(events[i + 1]))
        for i in range(steps)
    )
    return {"kind": "drv_agrees", "max_abs_diff_ms": round(worst, 6), "pairs": steps}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    loop = build_loop("resnet18", "cuda:0", small=False)
    for _ in range(30):
        loop.step()
    stream = torch.cuda.current_stream()
    c_record = torch._C._CudaEventBase.record
    get_stream, get_device = torch._C._cuda_getCurrentStream, torch._C._cuda_getDevice
    raw_stream = torch._C._cuda_getCurrentRawStream
    drv = DriverEvents()
    lines = [driver_agreement(loop, 64)]
    print(json.dumps(lines[0]), flush=True)
    for _ in range(args.repeats):
        for kind in KINDS:
            pool = [torch.cuda.Event(enable_timing=True) for _ in range(8)]
            handles = created_handles(pool)
            c60, cfb = C60Clock("cuda_event"), CfbClock("cuda_event")
            clock = StepClock("cuda_event")
            cpus, walls = [], []
            for i in range(args.steps):
                loop.step()
                event, old, older = pool[i % 8], pool[(i + 4) % 8], pool[(i + 3) % 8]
                if kind in ("query_old", "elapsed_old", "drv_query_old", "drv_elapsed_old"):
                    event.record(stream)  # untimed: these kinds time reading old events
                ready = i >= 8 and kind in ("elapsed_old", "drv_elapsed_old") and old.query()
                cpu, wall = time.thread_time_ns(), time.perf_counter_ns()
                if kind == "bare_pool8":
                    event.record(stream)
                elif kind == "c_record":
                    c_record(event, stream)
                elif kind == "stream_key":
                    get_stream(get_device())
                elif kind == "current_stream":
                    torch.cuda.current_stream()
                elif kind == "query_old" and i >= 8:
                    old.query()
                elif kind == "elapsed_old" and ready:
                    older.elapsed_time(old)
                elif kind == "c60ff5f_mark":
                    c60.mark(i)
                elif kind == "cfb7e3e_mark":
                    cfb.mark(i)
                elif kind == "clock_mark":
                    clock.mark(i)
                elif kind == "raw_stream":
                    raw_stream(get_device())
                elif kind == "drv_record":
                    drv.record(handles[i % 8], raw_stream(get_device()))
                elif kind == "drv_query_old" and i >= 8:
                    drv.query(handles[(i + 4) % 8])
                elif kind == "drv_elapsed_old" and ready:
                    drv.elapsed_ms(handles[(i + 3) % 8], handles[(i + 4) % 8])
                elif kind == "drv_mark":
                    drv.record(handles[i % 8], raw_stream(get_device()))
                    # a clock's poll every 4 steps: one query, then 4 durations between
                    # events the GPU has passed (step i-k is in pool slot (i + 8 - k) % 8;
                    # one stream's events complete in order, so i-4 passed means all did)
                    if i >= 8 and i % 4 == 0 and drv.query(handles[(i + 4) % 8]):
                        for start, end in ((1, 2), (2, 3), (3, 4), (1, 4)):
                            drv.elapsed_ms(handles[(i + start) % 8], handles[(i + end) % 8])
                walls.append(time.perf_counter_ns() - wall)
                cpus.append(time.thread_time_ns() - cpu)
                if kind == "c60ff5f_mark" and i % 32 == 0:
                    c60.poll()
            torch.cuda.synchronize()
            line = {
                "kind": kind,
                "cpu_us_median": round(statistics.median(cpus) / 1e3, 2),
                "wall_us_median": round(statistics.median(walls) / 1e3, 2),
                "cpu_us_mean": round(statistics.fmean(cpus) / 1e3, 2),
            }
            if kind == "clock_mark":
                line["fast_path"] = clock._calls.fast if clock._calls is not None else None
            lines.append(line)
            print(json.dumps(line), flush=True)
    if args.out:
        facts = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
        Path(args.out).write_text(json.dumps({"facts": facts, "blocks": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
