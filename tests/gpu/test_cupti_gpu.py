"""The cupti backend on a real NVIDIA GPU (skipped without CUDA).

Run on the device machine: `python3 -m pytest tests/gpu -q -m gpu`. Each test prints
what it measured (run with -s, or read the device check's log) so a failure says why.
Tests share the process, as a training job would: the backend is started and closed
several times in it.
"""

from __future__ import annotations

import faulthandler
import json
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from distanom.tracers.base import Availability, StepTrace  # noqa: E402
from distanom.tracers.cupti import CuptiTracer, probe_cupti  # noqa: E402
from tests.gpu.cupti_gpu_helper import tracer_config  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SPIN = "spin_kernel"


class Work:
    def __init__(self, kernels: int = 0) -> None:
        torch.manual_seed(0)
        self.x = torch.randn(512, 512, device="cuda")
        self.w = torch.randn(512, 512, device="cuda")
        self.acc = torch.zeros(512, device="cuda")
        self.extra = kernels

    def step(self, sleep_cycles: int = 0) -> None:
        y = torch.relu(self.x @ self.w)
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        self.acc += y.sum(dim=0)
        for _ in range(self.extra):
            self.acc.add_(1.0)


@pytest.fixture
def make_tracer() -> Iterator[Any]:
    made: list[CuptiTracer] = []

    def make(**kw: Any) -> CuptiTracer:
        torch.cuda.synchronize()
        t = CuptiTracer(tracer_config(**kw), rank=0)
        t.start()
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def run_steps(tracer: CuptiTracer, work: Work, first: int, last: int, **per_step: Any) -> None:
    for s in range(first, last + 1):
        work.step(**per_step.get(str(s), {}))
        tracer.mark_step(s, time.time_ns())


def wait_ready(tracer: CuptiTracer, step: int, timeout: float = 10.0) -> StepTrace:
    deadline = time.monotonic() + timeout
    while True:
        state, why = tracer.explain(step)
        if state is Availability.READY:
            return tracer.step_trace(step)
        if state is Availability.GONE:
            pytest.fail(f"step {step} is GONE: {why}; tracer stats {tracer.stats()}")
        if time.monotonic() > deadline:
            pytest.fail(f"step {step} still PENDING after {timeout}s: {why}; {tracer.stats()}")
        time.sleep(0.01)


def kernels(trace: StepTrace) -> list[str]:
    return [e["name"] for e in trace.events if e.get("cat") == "kernel"]


def assert_clean(trace: StepTrace) -> None:
    st = trace.stats
    assert st["marker_verified"] == 1, st
    assert st["zero_timestamp_dropped"] == 0, st
    assert st["end_before_start_dropped"] == 0, st
    assert st["cupti_dropped_records"] == 0, st
    assert st["unreadable_names"] == 0, st


def test_probe_says_available() -> None:
    assert probe_cupti() is None


def test_calibration_learned_distinct_marker_grids(make_tracer: Any) -> None:
    tracer = make_tracer()
    cal = tracer.calibration
    print(f"\ncalibration: {cal}")
    assert cal is not None
    assert len(set(cal.grids)) == len(cal.grids) == 16
    assert cal.marker == "driver", "the driver-launched marker should load on NVIDIA"
    assert cal.grids == [c + 1 for c in range(16)]
    assert cal.memcpy_checked
    assert cal.size_walk_checked, "record sizes disagree with cuptiActivityGetNextRecord"
    assert abs(cal.clock_offset_ns) < 1_000_000


def test_jiterator_fallback_marker_serves_steps(
    make_tracer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import distanom.tracers.cupti.tracer as tracer_mod
    from distanom.tracers.cupti.marker import JiteratorMarker

    monkeypatch.setattr(tracer_mod, "create_marker", JiteratorMarker)
    tracer = make_tracer()
    cal = tracer.calibration
    assert cal is not None and cal.marker == "jiterator"
    assert cal.block_work_size is not None, f"grid != ceil(length / bw) for any bw: {cal.grids}"
    print(f"\njiterator grid formula verified: grid = ceil(length / {cal.block_work_size})")
    work = Work()
    run_steps(tracer, work, 0, 6, **{"4": {"sleep_cycles": 10_000_000}})
    torch.cuda.synchronize()
    for s in range(1, 7):
        t = wait_ready(tracer, s)
        assert_clean(t)
        assert any("spin_kernel" in k for k in kernels(t)) == (s == 4), s


def test_injected_sleep_is_in_its_step_and_no_other(make_tracer: Any) -> None:
    tracer = make_tracer()
    work = Work()
    run_steps(tracer, work, 0, 11, **{"8": {"sleep_cycles": 10_000_000}})
    torch.cuda.synchronize()
    traces = {s: wait_ready(tracer, s) for s in (6, 7, 8, 9, 10)}
    for s, t in traces.items():
        assert_clean(t)
        spins = [n for n in kernels(t) if SPIN in n]
        print(f"step {s}: {len(kernels(t))} kernels, spin {len(spins)}, stats {t.stats}")
        assert len(spins) == (1 if s == 8 else 0), (s, kernels(t))
        assert t.stats["outside_bounds"] == 0, t.stats
    assert len(kernels(traces[8])) == len(kernels(traces[7])) + 1
    assert len(kernels(traces[7])) == len(kernels(traces[9])) == len(kernels(traces[10]))
    spin = next(e for e in traces[8].events if SPIN in e.get("name", ""))
    print(f"spin kernel: {spin['dur']:.1f} µs, {spin['name']}")
    assert spin["dur"] > 2_000  # 10M cycles ~ 5 ms at 1.98 GHz


def run_helper(mode: str, steps: int) -> dict[str, Any]:
    """`cupti_gpu_helper.py` in a fresh process (CUPTI state is process-wide): its JSON."""
    proc = subprocess.run(
        [sys.executable, str(HERE / "cupti_gpu_helper.py"), "--mode", mode, "--steps", str(steps)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    assert proc.returncode == 0, f"{mode} helper failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_records_match_a_kineto_trace_of_the_same_ops() -> None:
    ours, theirs = run_helper("cupti", 4), run_helper("kineto", 4)
    assert theirs["markers"] == 5, theirs
    for step in ("1", "2", "3", "4"):
        a, b = ours["steps"][step], theirs["steps"][step]
        print(f"step {step}: cupti {Counter(c for c, _ in a)}  kineto {Counter(c for c, _ in b)}")
        assert Counter(c for c, _ in a) == Counter(c for c, _ in b), step
        diff = Counter(n for _, n in a) - Counter(n for _, n in b)
        assert not diff, f"names differ from Kineto's (demangling?): {diff}"
        assert ours["stats"][step]["zero_timestamp_dropped"] == 0


def test_tracing_off_and_on_at_step_boundaries(make_tracer: Any) -> None:
    tracer = make_tracer()
    work = Work()
    run_steps(tracer, work, 0, 7)
    tracer.set_tracing(False)  # after boundary 7 (marker 7 launched): detached now
    run_steps(tracer, work, 8, 11)
    tracer.set_tracing(True)  # after boundary 11: attached, then marker 11 launched now
    run_steps(tracer, work, 12, 17)
    torch.cuda.synchronize()
    states = {s: tracer.explain(s) for s in range(2, 18)}
    print("\n" + "\n".join(f"step {s}: {st.value} ({why})" for s, (st, why) in states.items()))
    # Step 7 being READY checks that a kernel launched just before the detach is still
    # recorded (synchronize + detach come right after marker 7); step 12 that the marker
    # launched by set_tracing(True) opens it.
    expected_ready = set(range(2, 8)) | set(range(12, 18))
    for s in range(2, 18):
        want = Availability.READY if s in expected_ready else Availability.GONE
        got = wait_ready(tracer, s).step if want is Availability.READY else None
        if want is Availability.GONE:
            assert states[s][0] is Availability.GONE, (s, states[s])
        else:
            assert got == s
    n = {len(kernels(wait_ready(tracer, s))) for s in expected_ready}
    assert len(n) == 1, n
    st = tracer.stats()
    print(
        f"toggles: {st['enables']} enables, {st['detaches']} detaches, {st['disables']} "
        f"disables, max {st['toggle_ns_max']} ns"
    )
    assert st["enables"] == 1 and st["detaches"] == 1 and st["disables"] == 0


def test_many_detach_attach_cycles_under_a_concurrent_reader(make_tracer: Any) -> None:
    # The governor's duty cycle: 2 steps on, 2 off, 60 times, while a capture thread
    # reads and flushes (a flush racing a detach is what CUPTI warns about).
    import resource

    tracer = make_tracer(history_steps=64)
    work = Work(kernels=20)
    served: dict[int, StepTrace] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = threading.Event()
    # Cycle c runs steps 4c..4c+3, traced, traced, untraced, untraced: switched on after
    # boundary 4c-1 (attach, marker 4c-1), off after boundary 4c+1 (detach). Step 0 has
    # no marker before it.
    traced = {4 * c + k for c in range(60) for k in (0, 1)} - {0}

    def capture() -> None:
        try:
            while not stop.is_set():
                with lock:
                    todo = sorted(traced - set(served))
                for s in todo:
                    if tracer.explain(s)[0] is Availability.READY:
                        trace = tracer.step_trace(s)
                        with lock:
                            served[s] = trace
                time.sleep(0.001)
        except BaseException as err:
            errors.append(err)

    faulthandler.dump_traceback_later(150, exit=True)
    reader = threading.Thread(target=capture, daemon=True)
    reader.start()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step = 0
    for _ in range(60):
        for on in (True, True, False, False):
            tracer.set_tracing(on)
            work.step()
            tracer.mark_step(step, time.time_ns())
            step += 1
    tracer.set_tracing(True)
    work.step()
    tracer.mark_step(step, time.time_ns())
    torch.cuda.synchronize()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not errors:
        with lock:
            if set(served) == traced:
                break
        time.sleep(0.01)
    stop.set()
    reader.join(30)
    faulthandler.cancel_dump_traceback_later()
    rss_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    st = tracer.stats()
    first_ids = sorted(
        (t.metadata["distanom"]["marker_correlation"][0] >> 32,
         min(e["args"]["correlation"] for e in t.events if e.get("cat") == "kernel"))
        for t in served.values()
    )  # fmt: skip
    print(
        f"\n{len(served)}/{len(traced)} traced steps served; {st['detaches']} detaches, "
        f"{st['enables']} attaches, max switch {st['toggle_ns_max'] / 1e6:.2f} ms, "
        f"mean {st['toggle_ns_total'] / max(1, st['detaches'] + st['enables']) / 1e6:.3f} ms; "
        f"max RSS +{rss_mb:.1f} MB; (epoch, first raw correlation) of the first steps "
        f"{first_ids[:4]}; buffers abandoned {st.get('buffers_abandoned')}"
    )
    assert not reader.is_alive() and not errors, errors
    assert set(served) == traced, sorted(traced - set(served))
    counts = {len(kernels(t)) for t in served.values()}
    assert len(counts) == 1, counts
    for t in served.values():
        assert_clean(t)
        assert t.stats["outside_bounds"] == 0
    assert st["detaches"] == 60 and st["detach_failures"] == 0
    assert st["mark_errors"] == 0 and st["callback_errors"] == 0
    assert st.get("buffers_abandoned", 0) == 0
    assert st["cupti_walks"] == 0  # every buffer walked by record size, no CUPTI call
    # Each detach hands back a partly filled buffer: growth is bounded by the ring.
    assert st["buffers_allocated"] <= 256 and rss_mb < 256 + 64


def test_the_boundary_marked_before_start_opens_the_first_step() -> None:
    # The agent marks boundary 0, then starts the tracer: step 1 must be servable.
    torch.cuda.synchronize()
    tracer = CuptiTracer(tracer_config(), rank=0)
    work = Work()
    work.step()
    tracer.mark_step(0, time.time_ns())
    tracer.start()
    try:
        assert tracer.boundary_flushes == 1  # step 1 carries the calibration
        run_steps(tracer, work, 1, 2)
        torch.cuda.synchronize()
        assert_clean(wait_ready(tracer, 1))
    finally:
        tracer.close()


def test_closing_while_detached_then_starting_again(make_tracer: Any) -> None:
    first = make_tracer()
    work = Work()
    run_steps(first, work, 0, 2)
    first.set_tracing(False)
    run_steps(first, work, 3, 4)
    assert first.stats()["detaches"] == 1
    first.close()
    second = make_tracer()
    run_steps(second, work, 0, 3)
    torch.cuda.synchronize()
    assert_clean(wait_ready(second, 3))


def test_pending_while_the_gpu_has_not_reached_the_marker(make_tracer: Any) -> None:
    tracer = make_tracer()
    work = Work()
    run_steps(tracer, work, 0, 2)
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~200 ms of GPU time before step 3's work
    run_steps(tracer, work, 3, 3)
    state, why = tracer.explain(3)
    print(f"\nright after launch: {state.value} ({why})")
    assert state is Availability.PENDING
    torch.cuda.synchronize()
    assert_clean(wait_ready(tracer, 3))


def test_kernel_on_a_side_stream_overlapping_the_marker_is_flagged(make_tracer: Any) -> None:
    tracer = make_tracer()
    work = Work()
    side = torch.cuda.Stream()
    run_steps(tracer, work, 0, 3)
    work.step()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # ~25 ms, still running when marker 4 runs
    tracer.mark_step(4, time.time_ns())
    torch.cuda.current_stream().wait_stream(side)
    run_steps(tracer, work, 5, 6)
    torch.cuda.synchronize()
    t = wait_ready(tracer, 4)
    spin = [e for e in t.events if SPIN in e.get("name", "")]
    print(f"\nstep 4 stats {t.stats}; spin on stream {[e['tid'] for e in spin]}")
    assert len(spin) == 1 and spin[0]["tid"] != next(
        e["tid"] for e in t.events if e.get("cat") == "kernel" and SPIN not in e["name"]
    )
    assert t.stats["outside_bounds"] >= 1
    assert_clean(t)


def test_small_ring_evicts_old_steps_and_keeps_recent_ones(make_tracer: Any) -> None:
    # 8 MB ring = 8 buffers of 1 MB (~4,800 kernel records each); ~400 kernels a step.
    tracer = make_tracer(ring_mb=8, history_steps=10_000)
    work = Work(kernels=400)
    run_steps(tracer, work, 0, 120)
    torch.cuda.synchronize()
    states = [tracer.availability(s) for s in range(1, 121)]
    st = tracer.stats()
    print(f"\nring stats: {st}")
    print(f"READY {states.count(Availability.READY)}, GONE {states.count(Availability.GONE)}")
    assert st["buffers_evicted"] > 0
    assert st["buffers_allocated"] <= 8
    assert st["cupti_dropped_records"] == 0
    assert states[0] is Availability.GONE
    last = wait_ready(tracer, 120)
    assert_clean(last)
    assert len(kernels(last)) >= 400
    gone_after_ready = [
        s
        for s in range(2, 121)
        if states[s - 1] is Availability.GONE and states[s - 2] is Availability.READY
    ]
    assert not gone_after_ready, f"a GONE step after a READY one: {gone_after_ready}"


def test_many_steps_nothing_dropped_and_mark_step_is_cheap(make_tracer: Any) -> None:
    tracer = make_tracer()
    work = Work(kernels=50)
    costs: list[int] = []
    for s in range(300):
        work.step()
        t0 = time.perf_counter_ns()
        tracer.mark_step(s, time.time_ns())
        costs.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    med = statistics.median(costs) / 1000
    print(f"\nmark_step: median {med:.1f} µs, max {max(costs) / 1000:.1f} µs")
    for s in range(285, 300):
        t = wait_ready(tracer, s)
        assert_clean(t)
        assert t.stats["outside_bounds"] == 0
    assert tracer.availability(250) is Availability.GONE  # older than history_steps
    st = tracer.stats()
    print(f"tracer stats: {st}")
    assert st["mark_errors"] == 0 and st["lag_alarms"] == 0 and st["callback_errors"] == 0
    assert med < 200, "mark_step should cost tens of µs"


def test_capture_thread_reads_while_the_training_thread_launches(make_tracer: Any) -> None:
    # The agent's shape: training on the main thread, capture on another thread that
    # flushes CUPTI (whose completion callback needs the GIL) while kernels launch.
    # A deadlock between CUPTI's locks and the GIL would hang here (pytest-timeout).
    tracer = make_tracer()
    work = Work(kernels=100)
    served: list[StepTrace] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def capture() -> None:
        try:
            while not stop.is_set():
                last = tracer.last_step
                if last is not None and last >= 3:
                    state, _ = tracer.explain(last - 2)
                    if state is Availability.READY:
                        served.append(tracer.step_trace(last - 2))
                time.sleep(0.002)
        except BaseException as err:
            errors.append(err)

    # A GIL deadlock cannot be interrupted from Python: faulthandler's C watchdog dumps
    # every thread's stack and ends the process instead.
    faulthandler.dump_traceback_later(150, exit=True)
    reader = threading.Thread(target=capture, daemon=True)
    reader.start()
    t0 = time.perf_counter()
    run_steps(tracer, work, 0, 300)
    torch.cuda.synchronize()
    stop.set()
    reader.join(30)
    faulthandler.cancel_dump_traceback_later()
    took = time.perf_counter() - t0
    print(f"\n300 steps in {took:.2f} s with a reader; {len(served)} traces served")
    assert not reader.is_alive(), "capture thread hung"
    assert not errors, errors
    # The reader flushes CUPTI at most every 50 ms (StepResolver.MIN_FLUSH_INTERVAL_NS),
    # so ~0.4 s of training serves about 8-12 steps: enough to prove concurrent reads.
    assert len(served) >= 5
    for t in served:
        assert_clean(t)
        assert t.stats["kernels"] == served[0].stats["kernels"]


def test_close_is_idempotent_and_a_new_tracer_starts_after_it(make_tracer: Any) -> None:
    first = make_tracer()
    first.close()
    first.close()
    assert first.availability(1) is Availability.GONE
    second = make_tracer()
    work = Work()
    run_steps(second, work, 0, 3)
    torch.cuda.synchronize()
    assert_clean(wait_ready(second, 3))


def test_after_torch_profiler_the_backend_refuses_or_works() -> None:
    out = run_helper("conflict", 4)
    print(f"\nafter torch.profiler: {out}")
    if out["start"] != "ok":
        assert out["start"].startswith("unavailable:")
        assert out["probe"] is not None  # probe_cupti must have said so too
    else:
        assert len(set(out["kernels"])) == 1 and out["kernels"][0] > 0, out


def test_torch_profiler_still_works_after_the_backend_closed() -> None:
    out = run_helper("kineto_after", 3)
    print(f"\nKineto after distanom: {out}")
    assert out["kineto_kernels"] > 0
