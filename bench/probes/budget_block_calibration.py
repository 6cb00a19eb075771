"""Does the in-process budget-block comparison read zero when nothing is traced?

    python3 bench/probes/budget_block_calibration.py --pairs 64 --out "$OUT"

Device probe for bench/overhead.py's budget blocks (issue 4). Governed blocks that held
no traced step read ~2% slower than the tracing-off blocks next to them. Here, in one
ResNet18 process with the cupti tracer started and then switched off (detached), the
same block comparison runs first with a governor that never traces (an A/A test of the
method and of the governed loop's bookkeeping), then with the real 1% budget governor.
Writes budget_block_calibration.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


class NeverTraces:
    """Governor stand-in: records nothing, never traces."""

    def record(self, *args: Any) -> None:
        return None

    def tracing_on(self, step: int) -> bool:
        return False

    def report(self) -> dict[str, Any]:
        return {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=64)
    parser.add_argument("--block-steps", type=int, default=64)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()

    import torch
    from overhead import _budget_blocks, _govern, _tracer_config, build_workload

    from distanom.governor import GovernorParams, OverheadGovernor
    from distanom.tracers.cupti import CuptiTracer

    work = build_workload("resnet18", 10)
    for _ in range(30):
        work.step(0)
    torch.cuda.synchronize()
    tracer = CuptiTracer(_tracer_config(1.0), rank=0)
    tracer.mark_step(0, time.time_ns())
    tracer.start()
    step = 1
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    governor = OverheadGovernor(1.0, GovernorParams(window_steps=16, lag_steps=2), first_step=1)
    state: dict[str, Any] = {"on": True, "g": 1, "after_flush": False, "prev_on": True}
    state["last"] = time.perf_counter()
    for _ in range(400):  # let the real governor settle, as the bench's timed loop does
        work.step(0)
        flushes = tracer.boundary_flushes
        tracer.mark_step(step, time.time_ns())
        _govern(tracer, governor, state, flushes)
        step += 1
    for name, gov in (("never_traces", NeverTraces()), ("budget_1pct", governor)):
        st = dict(state) if name == "budget_1pct" else {
            "on": False, "g": 1, "after_flush": False, "prev_on": False, "last": 0.0}  # fmt: skip
        res = _budget_blocks(tracer, gov, work, step, st, args.block_steps, args.pairs)
        step += sum(n for n, _ in res["governed"]) + sum(n for n, _ in res["off"])
        res.pop("governor", None)
        out[name] = res
        print(name, res["budget_overhead_pct"], res["coverage"], flush=True)
    tracer.close()
    Path(args.out, "budget_block_calibration.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
