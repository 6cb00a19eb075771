"""How long the CUPTI tracer's untraced boundary takes with nothing else running: the
fake-CUDA tracer of the unit tests (tests/unit/test_cupti_mark_step.py), untraced, in a
tight loop, beside the clock reads it makes. Compare with boundary_cost_probe's in-loop
median: the difference is what the loop around it (other threads, caches) adds.

    python3 bench/probes/untraced_mark_micro.py
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "unit")]

from test_cupti_mark_step import running_tracer  # noqa: E402


def per_call_ns(fn: object, n: int) -> float:
    call = fn  # a bound callable taking the loop index
    t0 = time.perf_counter_ns()
    for i in range(n):
        call(i)  # type: ignore[operator]
    return (time.perf_counter_ns() - t0) / n


def main() -> int:
    tracer, _ = running_tracer(history=32)
    tracer.mark_step(1, 100)
    tracer.set_tracing(False)
    n = 200_000
    base = 10
    out = {
        "host": platform.node(),
        "python": platform.python_version(),
        "untraced_mark_step_ns": per_call_ns(lambda i: tracer.mark_step(base + i, i), n),
        "time_ns_ns": per_call_ns(lambda i: time.time_ns(), n),
        "monotonic_ns_ns": per_call_ns(lambda i: time.monotonic_ns(), n),
        "perf_counter_ns_ns": per_call_ns(lambda i: time.perf_counter_ns(), n),
        "thread_time_ns_ns": per_call_ns(lambda i: time.thread_time_ns(), n),
        "empty_lambda_ns": per_call_ns(lambda i: None, n),
    }
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
