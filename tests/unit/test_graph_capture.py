"""CUDA graph captures kept apart from distanom's CUDA calls (`distanom.graph_capture`):
the wrapped capture_begin/capture_end count captures in flight, other threads' event
queries wait out or skip a capture, a step boundary inside a capture is no step but makes
each replay of that graph a step, and the step after a capture gets no duration. On CPU:
a fake graph class, and captures simulated with `CAPTURES.began()`/`ended()` around a
real agent's loop (tests/gpu/test_graph_capture_gpu.py captures real graphs)."""

from __future__ import annotations

import contextlib
import csv
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from distanom.clock import StepClock
from distanom.graph_capture import CAPTURES, STEP_MARK, STUCK_BOUNDARIES, GraphCaptures
from distanom.phases import _FWD_END as FWD_END
from distanom.phases import _FWD_START as FWD_START
from distanom.phases import PhaseMarks
from tests.unit.test_agent_steps import make_agent
from tests.unit.test_clock import FakeGpu


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph: records the calls that reach it."""

    calls: ClassVar[list[str]] = []
    fail_begin = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        if FakeGraph.fail_begin:
            raise RuntimeError("capture_begin failed")
        FakeGraph.calls.append(f"begin:{capture_error_mode}")

    def capture_end(self) -> None:
        FakeGraph.calls.append("end")

    def replay(self) -> None:
        FakeGraph.calls.append("replay")


@pytest.fixture
def fake_graph() -> Any:
    FakeGraph.calls, FakeGraph.fail_begin = [], False
    captures = GraphCaptures()
    assert captures.install(FakeGraph) and captures.installed
    yield captures
    captures.uninstall()
    assert "capture_begin" in FakeGraph.__dict__ and not captures.installed


def test_captures_in_flight_are_counted_and_the_originals_still_run(fake_graph: Any) -> None:
    graph = FakeGraph()
    graph.capture_begin(capture_error_mode="thread_local")
    assert fake_graph.capturing == 1
    graph.capture_end()
    assert fake_graph.capturing == 0 and fake_graph.seen == 1
    assert FakeGraph.calls == ["begin:thread_local", "end"]
    assert FakeGraph.capture_begin.__name__ == "capture_begin"  # functools.wraps


def test_a_failed_begin_leaves_no_capture_counted(fake_graph: Any) -> None:
    FakeGraph.fail_begin = True
    with pytest.raises(RuntimeError, match="capture_begin failed"):
        FakeGraph().capture_begin()
    assert fake_graph.capturing == 0


def test_install_twice_wraps_once_and_uninstall_restores(fake_graph: Any) -> None:
    wrapped = FakeGraph.__dict__["capture_begin"]
    assert fake_graph.install(FakeGraph)
    assert FakeGraph.__dict__["capture_begin"] is wrapped
    FakeGraph().capture_begin()
    assert fake_graph.capturing == 1  # counted once, not twice


def test_a_class_without_the_methods_is_not_watched_and_nothing_raises() -> None:
    assert not GraphCaptures().install(object)


def test_torchs_graph_class_can_be_wrapped_here() -> None:
    graph_class = torch.cuda.graphs.CUDAGraph  # a placeholder on a CPU build
    # an agent may have wrapped them already: each is put back as it was
    names = ("capture_begin", "capture_end", "replay")
    before = {name: vars(graph_class)[name] for name in names}
    graphed = torch.cuda.make_graphed_callables
    captures = GraphCaptures()
    try:
        assert captures.install()
        for name in names:
            assert vars(graph_class)[name].__wrapped__ is before[name]
        assert torch.cuda.make_graphed_callables.__wrapped__ is graphed  # type: ignore[attr-defined]
        assert torch.cuda.graphs.make_graphed_callables is torch.cuda.make_graphed_callables
    finally:
        captures.uninstall()
    assert {name: vars(graph_class)[name] for name in names} == before
    assert torch.cuda.make_graphed_callables is graphed


def test_a_query_is_skipped_during_a_capture_and_a_capture_waits_for_one_in_flight() -> None:
    captures = GraphCaptures()
    asked: list[str] = []
    assert captures.quiet_query(lambda: asked.append("q") or True, while_capturing=False)
    captures.began()
    assert not captures.quiet_query(lambda: asked.append("q") or True, while_capturing=False)
    captures.ended()
    assert asked == ["q"]

    order: list[str] = []
    inside = threading.Event()

    def slow_query() -> bool:
        inside.set()
        time.sleep(0.2)
        order.append("query returned")
        return True

    reader = threading.Thread(target=captures.quiet_query, args=(slow_query, False))
    reader.start()
    assert inside.wait(5)
    captures.began()  # must not begin while the query is in flight
    order.append("capture began")
    reader.join()
    captures.ended()
    assert order == ["query returned", "capture began"]


def captured() -> None:
    """A whole capture on this thread, as the wrappers report it."""
    CAPTURES.began()
    CAPTURES.ended()


def test_the_event_clock_gives_no_duration_to_the_step_after_a_capture() -> None:
    gpu = FakeGpu()
    clock = StepClock("cuda_event", calls=gpu)  # type: ignore[arg-type]
    got: dict[int, float] = {}
    for step in range(10):
        if step == 6:  # a capture (and replays) between boundaries 5 and 6
            captured()
        got.update(clock.mark(step))
    got.update(clock.drain(1.0)[0])
    assert sorted(got) == [1, 2, 3, 4, 5, 7, 8, 9]
    assert not clock._gaps  # forgotten once read


def test_the_host_clock_gives_no_duration_to_the_step_after_a_capture() -> None:
    ticks = iter(range(0, 10**9, 1_000_000))
    clock = StepClock("host", now_ns=lambda: next(ticks))
    got: list[int] = []
    for step in range(6):
        if step == 3:
            captured()
        got += [s for s, _ms in clock.mark(step)]
    assert got == [1, 2, 4, 5]


def test_phase_marks_take_nothing_inside_a_capture() -> None:
    marks = PhaseMarks()
    marks.optimizer_started()
    CAPTURES.began()
    try:
        marks.optimizer_started()
        marks._mark(0)
    finally:
        CAPTURES.ended()
    assert len(marks._marks) == 1


def steps_file(agent: Any) -> list[int]:
    with open(agent.run.steps_csv(0)) as handle:
        return [int(row["step"]) for row in csv.DictReader(handle)]


class Loop:
    """A tiny model and optimizer; `iterations(n)` runs n forward, backward and steps."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(8, 2)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def backward(self) -> None:
        self.model(torch.randn(4, 8)).sum().backward()

    def iterations(self, count: int) -> None:
        for _ in range(count):
            self.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


@contextlib.contextmanager
def capture_on_another_thread() -> Iterator[None]:
    """A capture in flight on another thread for the duration of the block."""
    begun, done = threading.Event(), threading.Event()

    def capturing() -> None:
        CAPTURES.began()
        begun.set()
        done.wait(10)
        CAPTURES.ended()

    other = threading.Thread(target=capturing)
    other.start()
    try:
        assert begun.wait(10)
        yield
    finally:
        done.set()
        other.join()


def test_an_agent_skips_the_steps_of_a_capture_and_never_judges_the_one_after(
    tmp_path: Path,
) -> None:
    loop = Loop()
    train = loop.iterations
    agent = make_agent(tmp_path)
    train(5)
    CAPTURES.began()  # what torch.cuda.graph's capture_begin does through the wrapper
    try:
        train(3)  # the captured iterations: recorded into a graph, not run
        assert agent.current_step == 5
    finally:
        CAPTURES.ended()
    train(4)
    assert agent.current_step == 9
    agent.close()
    assert steps_file(agent) == [1, 2, 3, 4, 6, 7, 8]  # step 5 spans the capture


def test_the_capture_threads_gpu_check_asks_nothing_during_a_capture() -> None:
    from tests.unit.test_cupti_mark_step import running_tracer

    tracer, _log = running_tracer()
    asked: list[int] = []
    event = type("Event", (), {"query": lambda self: asked.append(1) or True})()
    tracer._step_events.append((3, event))
    CAPTURES.began()
    try:
        assert not tracer.gpu_passed(3)  # not known yet: the resolver waits
    finally:
        CAPTURES.ended()
    assert asked == []
    assert tracer.gpu_passed(3) and asked == [1]


def test_the_model_can_be_graphed_mid_run_and_keeps_its_phase_marks(tmp_path: Path) -> None:
    # torch.cuda.make_graphed_callables refuses a module with forward hooks; the phase
    # marks hook the model at the first step. On CPU the call fails later (no CUDA), but
    # no longer at the hooks check, and the hooks are back after it.
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = make_agent(tmp_path)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    assert len(model._forward_hooks) == 1 and len(model._forward_pre_hooks) == 1
    sample = (torch.randn(4, 8),)
    original = torch.cuda.make_graphed_callables.__wrapped__  # type: ignore[attr-defined]
    with pytest.raises(AssertionError, match="must not have hooks"):
        original(model, sample)  # what a script met before
    with pytest.raises(Exception) as raised:
        torch.cuda.make_graphed_callables(model, sample)
    assert "must not have hooks" not in str(raised.value)
    assert len(model._forward_hooks) == 1 and len(model._forward_pre_hooks) == 1
    model(torch.randn(4, 8)).sum().backward()
    kinds = [kind for kind, _ns, _event in agent.boundaries.phases._marks]
    assert kinds[:2] == [FWD_START, FWD_END]  # the model's marks are taken again
    optimizer.step()
    agent.close()


def test_only_a_graph_that_captured_a_step_ends_one_at_each_replay(fake_graph: Any) -> None:
    ended: list[int] = []
    fake_graph.replayed_step = lambda: ended.append(1)
    with_step, without = FakeGraph(), FakeGraph()
    with_step.capture_begin()
    fake_graph.step_captured()  # what a boundary inside the capture does
    with_step.capture_end()
    without.capture_begin()
    without.capture_end()
    for _ in range(3):
        with_step.replay()
        without.replay()
    assert len(ended) == 3 and FakeGraph.calls.count("replay") == 6


FAKE_GRAPHED = SimpleNamespace(calls=[])


def fake_make_graphed_callables(callables: Any, sample_args: Any) -> Any:
    """Records, per module given, whether it had forward hooks when called (torch refuses
    a hooked module)."""
    given = callables if isinstance(callables, tuple) else (callables,)
    FAKE_GRAPHED.calls.append([bool(m._forward_hooks or m._forward_pre_hooks) for m in given])
    return callables


@pytest.fixture
def agent_on_fake_graphs() -> Any:
    # the process-wide one (an agent may have put it on torch's class): on the fakes for
    # the test, then back as it was
    was_installed = CAPTURES.installed
    CAPTURES.uninstall()
    FakeGraph.calls, FakeGraph.fail_begin = [], False
    FAKE_GRAPHED.calls = []
    FAKE_GRAPHED.make_graphed_callables = fake_make_graphed_callables
    assert CAPTURES.install(FakeGraph, [FAKE_GRAPHED])
    yield
    CAPTURES.uninstall()
    if was_installed:
        CAPTURES.install()


def test_an_agent_times_each_replay_of_a_captured_iteration_as_a_step(
    tmp_path: Path, agent_on_fake_graphs: None
) -> None:
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = make_agent(tmp_path)

    def iteration() -> None:
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(5):
        iteration()
    graph = FakeGraph()
    graph.capture_begin()
    iteration()  # captured: runs at each replay
    graph.capture_end()
    assert agent.current_step == 5
    for _ in range(6):
        graph.replay()
    assert agent.current_step == 11
    for _ in range(3):
        iteration()
    agent.close()
    assert steps_file(agent) == [1, 2, 3, 4, *range(6, 14)]  # step 5 spans the capture


def test_with_manual_steps_the_script_ends_its_replayed_steps_itself(
    tmp_path: Path, agent_on_fake_graphs: None
) -> None:
    import distanom

    agent = make_agent(tmp_path, "step.source=manual")
    for _ in range(3):
        distanom.step()
    graph = FakeGraph()
    graph.capture_begin()
    distanom.step()  # inside the capture: not a step now
    graph.capture_end()
    for _ in range(4):
        graph.replay()
        distanom.step()  # the script's own end of each replayed iteration
    assert agent.current_step == 7  # not 11: a replay does not end a step as well
    agent.close()


def test_a_capture_on_another_thread_leaves_the_training_threads_steps_alone(
    tmp_path: Path,
) -> None:
    loop = Loop()
    agent = make_agent(tmp_path)
    try:
        with capture_on_another_thread():  # e.g. a thread_local-mode capture of other work
            loop.iterations(4)
            assert agent.current_step == 4  # counted: this thread captures nothing
            loop.backward()  # and its marks are taken
            kinds = [kind for kind, _ns, _e in agent.boundaries.phases._marks]
            assert kinds[:2] == [FWD_START, FWD_END]
    finally:
        agent.close()


def test_a_graph_captured_again_without_a_step_stops_ending_steps(fake_graph: Any) -> None:
    ended: list[int] = []
    fake_graph.replayed_step = lambda: ended.append(1)
    graph = FakeGraph()
    graph.capture_begin()
    fake_graph.step_captured()
    graph.capture_end()
    graph.replay()
    graph.capture_begin()  # reset() and captured again: a forward only, say
    graph.capture_end()
    graph.replay()
    assert ended == [1]


def test_a_step_inside_nested_captures_belongs_to_the_inner_one_and_the_outer_survives(
    fake_graph: Any,
) -> None:
    outer, inner = FakeGraph(), FakeGraph()
    outer.capture_begin()
    inner.capture_begin()
    fake_graph.step_captured()
    inner.capture_end()
    assert fake_graph.here() and fake_graph.capturing == 1
    fake_graph.step_captured()  # after the inner one ended: the outer graph's
    outer.capture_end()
    assert not fake_graph.here() and fake_graph.capturing == 0
    assert getattr(inner, STEP_MARK) and getattr(outer, STEP_MARK)


def test_a_failing_capture_end_still_ends_the_count(fake_graph: Any) -> None:
    class FailingEnd(FakeGraph):
        pass

    def broken_end(self: Any) -> None:
        raise RuntimeError("capture invalidated")

    captures = GraphCaptures()
    FailingEnd.capture_end = broken_end  # type: ignore[method-assign]
    assert captures.install(FailingEnd)
    try:
        FailingEnd().capture_begin()
        with pytest.raises(RuntimeError, match="invalidated"):
            FailingEnd().capture_end()
        assert captures.capturing == 0 and not captures.here()
    finally:
        captures.uninstall()


def test_a_capture_never_seen_to_end_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    captures = GraphCaptures()
    captures.began()
    with caplog.at_level("WARNING"):
        for _ in range(STUCK_BOUNDARIES + 5):
            captures.step_captured()
    captures.ended()
    assert sum("never seen" in r.getMessage() for r in caplog.records) == 1


def test_another_threads_query_gives_way_to_a_held_lock_without_waiting() -> None:
    captures = GraphCaptures()
    with captures.lock:  # a capture beginning, or a deferred reader's round of reads
        took = time.perf_counter()
        assert captures.quiet_query(lambda: True, while_capturing=False) is False
        assert time.perf_counter() - took < 0.5


def test_a_deferred_read_makes_no_event_query_during_a_capture(tmp_path: Path) -> None:
    from tests.unit.test_deferred_clock import StrictGpu, deferred

    loop = Loop()
    agent = make_agent(tmp_path, "consensus.interval_ms=20")
    gpu = StrictGpu()
    agent.clock = deferred(gpu)
    try:
        loop.iterations(6)
        with capture_on_another_thread():  # global mode there: no query of ours may run
            queries = gpu.queries
            assert agent.boundaries.collect() == []
            time.sleep(0.1)  # the control thread's own takes meanwhile: no query either
            assert gpu.queries == queries
        gpu.passed = gpu.recorded  # once it ended, the steps are read
    finally:
        agent.close()
    assert steps_file(agent) == [1, 2, 3, 4, 5]


def test_graphing_keeps_hooks_on_a_submodule_and_lifts_them_off_the_model_in_a_tuple(
    tmp_path: Path, agent_on_fake_graphs: None
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = make_agent(tmp_path)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
    sample = (torch.randn(4, 8),)
    FAKE_GRAPHED.make_graphed_callables(model[0], sample)  # not the hooked model
    model[0].register_forward_hook(lambda *a: None)  # the script's own hook stays seen
    FAKE_GRAPHED.make_graphed_callables((model[0], model), (sample, sample))
    assert FAKE_GRAPHED.calls == [[False], [True, False]]  # the model's hooks were lifted
    assert len(model._forward_hooks) == 1  # and put back

    def broken(given: Any) -> Any:
        raise RuntimeError("a lifter that fails")

    CAPTURES.hook_lifters.append(broken)
    try:
        FAKE_GRAPHED.make_graphed_callables(model, sample)  # goes ahead all the same
    finally:
        CAPTURES.hook_lifters.remove(broken)
    assert FAKE_GRAPHED.calls[-1] == [False]
    agent.close()
    assert CAPTURES.replayed_step is None  # the closed agent's boundaries let go
