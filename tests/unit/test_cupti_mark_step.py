"""CuptiTracer.mark_step, the training-thread path, with torch and CUPTI faked.

Checks the order of attach / marker launch / synchronize + detach at a boundary (which
decides which steps are traced), the fallback to disabling when CUPTI cannot detach, the
marker codes, the lag probe, and that nothing raises.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from distanom.tracers.cupti import CuptiTracer
from distanom.tracers.cupti.buffers import BufferPool
from distanom.tracers.cupti.library import DetachError
from distanom.tracers.cupti.matching import MARKER_CODES
from distanom.tracers.cupti.names import NameTable
from distanom.tracers.cupti.resolver import StepResolver
from distanom.tracers.cupti.tracer import STEP_EVENTS


class FakeEvent:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.done = True

    def record(self) -> None:
        self.log.append("event")

    def query(self) -> bool:
        return self.done


class FakeSession:
    def __init__(self, log: list[str], can_detach: bool = True) -> None:
        self.log = log
        self.lib = SimpleNamespace(can_detach=can_detach)
        self.fail_detach = False
        self.attached = True

    def attach(self) -> None:
        self.log.append("attach")
        self.attached = True

    def disable(self) -> None:
        self.log.append("disable")

    def detach(self) -> None:
        if self.fail_detach:
            raise DetachError("cuptiFinalize failed: CUPTI error 7")
        self.log.append("detach")
        self.attached = False


def running_tracer(history: int = 16, can_detach: bool = True) -> tuple[CuptiTracer, list[str]]:
    log: list[str] = []
    cfg = SimpleNamespace(history_steps=history, ring_mb=8, overhead_budget_pct=None)
    t = CuptiTracer(cfg, rank=0)  # type: ignore[arg-type]
    capturing = {"on": False}
    t._torch = SimpleNamespace(
        cuda=SimpleNamespace(
            is_current_stream_capturing=lambda: capturing["on"],
            synchronize=lambda: log.append("sync"),
        )
    )
    t._capturing = capturing  # type: ignore[attr-defined]
    t._marker = SimpleNamespace(  # type: ignore[assignment]
        kind="fake", launch=lambda code: log.append(f"marker{code}"), close=lambda: None
    )
    t._session = FakeSession(log, can_detach)  # type: ignore[assignment]
    t._pool = BufferPool(4096, 2)
    t._resolver = StepResolver(
        t._pool,
        lambda a, s: [],
        NameTable(),
        grid_to_code={},
        num_codes=MARKER_CODES,
        history_steps=history,
    )
    t._append_mark = t._resolver.mark_appender()  # as start() sets it
    t._events = [FakeEvent(log) for _ in range(STEP_EVENTS)]
    t._tracing = True
    t._state = "running"
    return t, log


def marks(t: CuptiTracer) -> list[Any]:
    assert t._resolver is not None
    return t._resolver._snapshot()


def calls(log: list[str]) -> list[str]:
    return [x for x in log if x != "event"]


def test_switching_applies_at_the_boundary_just_marked() -> None:
    t, log = running_tracer()
    t.mark_step(1, 100)
    log.clear()
    t.set_tracing(False)  # after boundary 1: marker 1 closed step 1; step 2 is untraced
    # no new instrumented launch, drain the GPU (CUPTI's condition), detach
    assert calls(log) == ["disable", "sync", "detach"]
    log.clear()
    t.mark_step(2, 200)
    t.mark_step(3, 300)
    assert log == []  # tracing off: no marker
    t.set_tracing(True)  # after boundary 3: attach, then marker 3 opens step 4
    assert calls(log) == ["attach", "marker3"]
    t.set_tracing(True)  # already on: nothing
    assert calls(log) == ["attach", "marker3"]
    t.mark_step(4, 400)
    m = {x.step: x for x in marks(t)}
    assert (m[1].marker_launched, m[1].traced_after) == (True, False)
    assert (m[2].marker_launched, m[2].traced_after) == (False, False)
    assert (m[3].marker_launched, m[3].traced_after) == (True, True)
    assert (m[4].marker_launched, m[4].traced_after) == (True, True)
    assert m[3].code == 3 and m[3].host_end_ns == 300  # the boundary's own end time
    assert t.counters["enables"] == 1 and t.counters["detaches"] == 1
    assert t.counters["disables"] == 0


def test_a_switch_asked_before_the_first_mark_applies_there() -> None:
    t, log = running_tracer()
    t.set_tracing(False)
    assert log == []
    t.mark_step(1, 100)
    # marker first: it closes step 1
    assert calls(log) == ["marker1", "disable", "sync", "detach"]
    assert (marks(t)[-1].marker_launched, marks(t)[-1].traced_after) == (True, False)


def test_no_switch_inside_a_cuda_graph_capture() -> None:
    t, log = running_tracer()
    t.mark_step(1, 100)
    log.clear()
    t._capturing["on"] = True  # type: ignore[attr-defined]
    t.set_tracing(False)
    assert log == []  # deferred: no synchronize while capturing
    t._capturing["on"] = False  # type: ignore[attr-defined]
    t.mark_step(2, 200)
    assert calls(log) == ["marker2", "disable", "sync", "detach"]


def test_without_detach_off_windows_only_disable() -> None:
    t, log = running_tracer(can_detach=False)
    t.mark_step(1, 100)
    log.clear()
    t.set_tracing(False)
    assert calls(log) == ["disable"]  # no synchronize
    assert t.counters["disables"] == 1 and t.counters["detaches"] == 0


def test_a_failed_detach_falls_back_to_disabling_for_good(caplog: Any) -> None:
    t, log = running_tracer()
    assert t._session is not None
    t._session.fail_detach = True  # type: ignore[attr-defined]
    t.mark_step(1, 100)
    t.set_tracing(False)
    assert t._state == "running" and not t._tracing  # training and the tracer go on
    assert t.counters["detach_failures"] == 1 and t.counters["disables"] == 1
    t.mark_step(2, 200)
    t.set_tracing(True)
    t.mark_step(3, 300)
    log.clear()
    t.set_tracing(False)
    assert calls(log) == ["disable"]  # no second try
    assert t.counters["detach_failures"] == 1
    assert sum("cannot detach CUPTI" in r.getMessage() for r in caplog.records) == 1


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


def test_untraced_steps_make_no_cuda_call_and_still_mark_their_end() -> None:
    # The untraced boundary (most steps at a budget) skips the capture check: with no
    # marker to launch, a CUDA call per step would be cost for nothing.
    t, log = running_tracer()
    asked = []
    t._torch.cuda.is_current_stream_capturing = lambda: asked.append(1) or False
    t.mark_step(1, 100)
    t.set_tracing(False)
    asked.clear()
    log.clear()
    for s in range(2, 10):
        t.mark_step(s, s * 100)
    assert asked == [] and log == []
    tail = marks(t)[-8:]
    assert [m.step for m in tail] == list(range(2, 10))
    assert [m.host_end_ns for m in tail] == [s * 100 for s in range(2, 10)]
    assert not any(m.marker_launched or m.traced_after for m in tail)
    assert all(m.launch_mono_ns > 0 for m in tail)  # the resolver's horizon reads it
    assert t.counters["marks_untraced"] == 8
    t.set_tracing(True)  # a switch on checks again: no marker inside a graph
    assert asked == [1]


def test_a_switch_on_while_a_cuda_graph_is_being_captured_waits_for_the_next_mark() -> None:
    t, log = running_tracer()
    t.mark_step(1, 100)
    t.set_tracing(False)
    t.mark_step(2, 200)
    t._capturing["on"] = True  # type: ignore[attr-defined]
    log.clear()
    t.set_tracing(True)
    t.mark_step(3, 300)  # capturing: neither the attach nor a marker
    assert log == [] and t.counters["marks_while_capturing"] == 1
    t._capturing["on"] = False  # type: ignore[attr-defined]
    t.mark_step(4, 400)
    assert calls(log) == ["attach", "marker4"]


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

    t._marker = SimpleNamespace(kind="fake", launch=boom, close=lambda: None)  # type: ignore[assignment]
    t.mark_step(1, 0)  # must not raise
    assert t.failure is not None and "illegal memory access" in t.failure
    assert "disable" in log
    t.mark_step(2, 0)  # failed: a no-op from now on
    assert t.counters["mark_errors"] == 1


def test_off_and_on_again_at_one_boundary_launches_no_second_marker() -> None:
    # A second marker of the same code would be matched to the step 16 earlier.
    t, log = running_tracer()
    t.mark_step(5, 500)
    log.clear()
    t.set_tracing(False)
    t.set_tracing(True)
    assert calls(log) == ["disable", "sync", "detach", "attach"]
    last = marks(t)[-1]
    assert (last.step, last.marker_launched, last.traced_after) == (5, True, True)
    assert t.tracing
    t.mark_step(6, 600)
    assert calls(log)[-1] == "marker6"


def test_refused_attach_stops_the_tracer_and_says_it_is_off() -> None:
    from distanom.errors import TracerUnavailableError

    t, _ = running_tracer()
    assert t._session is not None

    def refuse() -> None:
        raise TracerUnavailableError("CUPTI already has a subscriber in this process")

    t.mark_step(1, 100)
    t.set_tracing(False)
    t._session.attach = refuse  # type: ignore[method-assign]
    t.mark_step(2, 200)
    t.set_tracing(True)  # must not raise into training
    assert t._state == "failed" and not t.tracing
    assert "subscriber" in (t.failure or "")


def test_a_detach_marks_the_next_step_as_carrying_its_cost() -> None:
    t, _ = running_tracer()
    t.mark_step(1, 100)
    before = t.boundary_flushes
    t.set_tracing(False)
    assert t.boundary_flushes == before + 1


def test_a_re_attach_marks_the_next_step_as_carrying_its_cost() -> None:
    # the step after an attach carries its cost: judged as ordinary, it would be an
    # anomaly distanom made itself (docs/cupti.md)
    t, _ = running_tracer()
    t.mark_step(1, 100)
    t.set_tracing(False)
    t.mark_step(2, 200)
    before = t.boundary_flushes
    t.set_tracing(True)
    assert t.boundary_flushes == before + 1
    t.mark_step(3, 300)
    t.set_tracing(True)  # already on: nothing to carry
    assert t.boundary_flushes == before + 1


def test_enabling_without_a_detach_before_carries_nothing() -> None:
    t, _ = running_tracer(can_detach=False)
    t.mark_step(1, 100)
    t.set_tracing(False)
    t.mark_step(2, 200)
    before = t.boundary_flushes
    t.set_tracing(True)
    assert t.boundary_flushes == before


def test_end_of_training_disables_without_draining_the_gpu() -> None:
    t, log = running_tracer()
    t.mark_step(1, 100)
    log.clear()
    t.end_of_training()
    assert calls(log) == ["disable"]  # no synchronize: a stuck kernel must not hang exit
    assert not t.tracing
    t.end_of_training()
    assert calls(log) == ["disable"]


def test_a_cupti_error_other_than_finalize_stops_the_tracer() -> None:
    from distanom.tracers.cupti.library import CuptiError

    t, _ = running_tracer()
    assert t._session is not None

    def flush_fails() -> None:
        raise CuptiError("cuptiActivityFlushAll", 7, "CUPTI_ERROR_INVALID_OPERATION")

    t._session.detach = flush_fails  # type: ignore[method-assign]
    t.mark_step(1, 100)
    t.set_tracing(False)  # must not raise; no silent fallback to an attached CUPTI
    assert t._state == "failed" and not t.tracing
    assert t.counters["detach_failures"] == 0


def test_a_failure_detaches_cupti_so_it_costs_nothing_afterwards() -> None:
    t, log = running_tracer()
    t.mark_step(1, 100)

    def boom(_: Any) -> None:
        raise RuntimeError("launch failed")

    t._marker = SimpleNamespace(kind="fake", launch=boom, close=lambda: None)  # type: ignore[assignment]
    log.clear()
    t.mark_step(2, 200)
    assert t._state == "failed"
    assert calls(log) == ["disable", "sync", "detach"]  # not left attached and disabled
