"""CuptiTracer.mark_step, the training-thread path, with torch and CUPTI faked.

Checks the order of enable / marker launch / disable at a boundary (which decides
which steps are traced), the marker codes, the lag probe, and that nothing raises.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from distanom.tracers.cupti import (
    MARKER_CODES,
    STEP_EVENTS,
    CuptiTracer,
    StepResolver,
)
from distanom.tracers.cupti_lib import BufferPool
from distanom.tracers.cupti_records import NameTable


class FakeEvent:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.done = True

    def record(self) -> None:
        self.log.append("event")

    def query(self) -> bool:
        return self.done


class FakeSession:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def enable(self) -> None:
        self.log.append("enable")

    def disable(self) -> None:
        self.log.append("disable")


def running_tracer(history: int = 16) -> tuple[CuptiTracer, list[str]]:
    log: list[str] = []
    cfg = SimpleNamespace(history_steps=history, ring_mb=8, overhead_budget_pct=None)
    t = CuptiTracer(cfg, rank=0)  # type: ignore[arg-type]
    capturing = {"on": False}
    t._torch = SimpleNamespace(
        cuda=SimpleNamespace(is_current_stream_capturing=lambda: capturing["on"])
    )
    t._capturing = capturing  # type: ignore[attr-defined]
    t._marker_inputs = list(range(MARKER_CODES))
    t._marker_fn = lambda code: log.append(f"marker{code}")
    t._session = FakeSession(log)  # type: ignore[assignment]
    t._resolver = StepResolver(
        BufferPool(4096, 2),
        lambda a, s: [],
        NameTable(),
        grid_to_code={},
        num_codes=MARKER_CODES,
        history_steps=history,
    )
    t._events = [FakeEvent(log) for _ in range(STEP_EVENTS)]
    t._tracing = True
    t._state = "running"
    return t, log


def marks(t: CuptiTracer) -> list[Any]:
    assert t._resolver is not None
    return t._resolver._snapshot()


def test_boundary_order_for_switching_off_and_on() -> None:
    t, log = running_tracer()
    t.mark_step(1, 100)
    t.set_tracing(False)
    log.clear()
    t.mark_step(2, 200)
    assert [x for x in log if x != "event"] == ["marker2", "disable"]  # marker, then off
    log.clear()
    t.mark_step(3, 300)
    assert log == []  # tracing off: no marker
    t.set_tracing(True)
    t.mark_step(4, 400)
    assert [x for x in log if x != "event"] == ["enable", "marker4"]  # on, then marker
    m = {x.step: x for x in marks(t)}
    assert (m[2].marker_launched, m[2].traced_after) == (True, False)
    assert (m[3].marker_launched, m[3].traced_after) == (False, False)
    assert (m[4].marker_launched, m[4].traced_after) == (True, True)
    assert m[4].code == 4 and m[2].host_end_ns == 200
    assert t.counters["enables"] == 1 and t.counters["disables"] == 1


def test_codes_wrap_and_steps_must_increase() -> None:
    t, log = running_tracer()
    for s in (15, 16, 17):
        t.mark_step(s, 0)
    t.mark_step(17, 0)  # repeated: ignored
    t.mark_step(3, 0)  # backwards: ignored
    assert [x for x in log if x.startswith("marker")] == ["marker15", "marker0", "marker1"]
    assert t.counters["marks_out_of_order"] == 2
    assert t.last_step == 17


def test_no_marker_while_a_cuda_graph_is_being_captured() -> None:
    t, log = running_tracer()
    t._capturing["on"] = True  # type: ignore[attr-defined]
    t.mark_step(1, 0)
    assert log == [] and t.counters["marks_while_capturing"] == 1


def test_lag_probe_flags_steps_when_the_gpu_falls_behind() -> None:
    t, log = running_tracer(history=1000)
    for s in range(1, 40):
        t.mark_step(s, 0)
    assert log.count("event") == 39  # one event after each marker
    assert t.counters["lag_alarms"] == 0
    assert t.gpu_passed(39) and t.gpu_passed(5)
    for ev in t._events:
        ev.done = False  # from now on the GPU reaches no marker
    for s in range(40, 60):
        t.mark_step(s, 0)
    assert not t.gpu_passed(59)
    assert t.counters["lag_alarms"] >= 1
    assert t._resolver is not None
    assert t._resolver._is_ambiguous(50)
    assert not t._resolver._is_ambiguous(20)


def test_a_failing_launch_disables_the_tracer_and_never_raises() -> None:
    t, log = running_tracer()

    def boom(_: Any) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    t._marker_fn = boom
    t.mark_step(1, 0)  # must not raise
    assert t.failure is not None and "illegal memory access" in t.failure
    assert "disable" in log
    t.mark_step(2, 0)  # failed: a no-op from now on
    assert t.counters["mark_errors"] == 1
