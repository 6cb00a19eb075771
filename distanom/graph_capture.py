"""CUDA graph captures in the watched process, kept apart from distanom's CUDA calls.

While a stream captures a CUDA graph in torch's default mode (`global`), a "potentially
unsafe" CUDA call from any thread of the process (an event query, a synchronize)
invalidates the capture and the script's `torch.cuda.graph` block raises. torch's own
NCCL watchdog had to stop querying events during captures for this reason (pytorch
#104555). distanom queries events to time steps, so it must know when a capture is on.

`CAPTURES.install()` (at the agent's install) wraps `torch.cuda.CUDAGraph.capture_begin`
and `capture_end`, through which torch's capturing APIs go (`torch.cuda.graph`,
`make_graphed_callables`, torch.compile's CUDA graphs), and counts the captures in
flight. What distanom does while one is:

- a step boundary inside a capture on its own thread (`here`) is not a step: the
  captured optimizer step runs at each replay, where no Python runs, so
  `StepBoundaries.boundary` skips it whole (no clock, no tracer mark), and the phase
  marks take nothing (`PhaseMarks`). The graph being captured is marked as holding a
  step (`step_captured`; the mark is cleared when it is captured again), and each of its
  replays (`CUDAGraph.replay`, wrapped too) then ends a step (`replayed_step`, the
  boundaries' callback): a loop that replays its whole iteration is watched. A graph
  that captured several iterations ends one step per replay;
- a capture on another thread leaves the training thread's steps alone: a script that
  trains while another thread captures must use `thread_local` or `relaxed` mode
  anyway (its own synchronizes would break a `global` capture), where they are safe;
- a thread other than the training thread makes its event queries holding
  `CAPTURES.lock`, and only while no capture is in flight (`quiet_query`);
  `capture_begin` takes the same lock before the capture starts, so no query of
  distanom's is in flight when one begins.

`make_graphed_callables` refuses a module with forward hooks, and the phase marks hook the
model after the first step: a script that graphs its model mid-run would fail. Its
wrapper lifts distanom's hooks off the modules it is given (`lift_hooks`, registered by
`PhaseMarks`) and puts them back after, which torch allows.

Captures started below torch's Python API (a C++ extension's own stream capture) are not
seen here; the CUPTI tracer's own check of the current stream still covers its switches.
A capture whose end is never seen keeps its thread's boundaries skipped: said once, after
`STUCK_BOUNDARIES`. Per step this costs an attribute read at the boundary, at the clock's
mark and at each phase mark; every `CUDAGraph.replay` goes through one more Python frame.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

STEP_MARK = "_distanom_holds_step"  # set on a graph whose capture held a step boundary
WRAPPED = ("capture_begin", "capture_end", "replay")  # CUDAGraph's methods
STUCK_BOUNDARIES = 1000  # boundaries inside one capture before saying it never ended


class GraphCaptures:
    """The count of CUDA graph captures in flight in this process; see the module
    docstring. One per process (`CAPTURES`)."""

    def __init__(self) -> None:
        self.capturing = 0  # captures begun and not ended (read without the lock)
        self.lock = threading.Lock()
        self.seen = 0  # captures begun since install
        self.replayed_step: Callable[[], None] | None = None  # a step graph was replayed
        self._stacks: dict[int, list[Any]] = {}  # thread ident -> its captures, innermost last
        self._skipped = 0  # boundaries inside the latest capture
        self._warned_stuck = False
        # each takes the modules make_graphed_callables is given, lifts distanom's hooks
        # off them and returns what puts them back
        self.hook_lifters: list[Callable[[Sequence[Any]], Callable[[], None]]] = []
        self._undo: list[Callable[[], None]] = []

    @property
    def installed(self) -> bool:
        """Whether the graph class's methods are wrapped."""
        return bool(self._undo)

    def install(self, graph_class: Any = None, graphed_owners: Sequence[Any] = ()) -> bool:
        """Wrap `graph_class`'s capture_begin, capture_end and replay (`WRAPPED`) and the
        `make_graphed_callables` of `graphed_owners` (modules); by default torch's
        (`torch.cuda.CUDAGraph`; `torch.cuda` and `torch.cuda.graphs`). Returns whether
        captures are watched. Again once installed: nothing."""
        if self._undo:
            return True
        try:
            if graph_class is None:
                import torch.cuda.graphs

                graph_class = torch.cuda.graphs.CUDAGraph
                graphed_owners = (torch.cuda.graphs, torch.cuda)
            originals = {name: getattr(graph_class, name) for name in WRAPPED}
        except Exception as err:  # another torch's layout: captures are not seen
            log.info("distanom: CUDA graph captures are not watched (%s)", err)
            return False
        begin, end, replay = (originals[name] for name in WRAPPED)
        own = {name for name in WRAPPED if name in vars(graph_class)}  # else inherited
        captures = self

        @functools.wraps(begin)
        def capture_begin(graph: Any, *args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(Exception):  # captured again: what it holds is new
                if getattr(graph, STEP_MARK, False):
                    setattr(graph, STEP_MARK, False)
            captures.began(graph)
            try:
                return begin(graph, *args, **kwargs)
            except BaseException:
                captures.ended()
                raise

        @functools.wraps(end)
        def capture_end(graph: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return end(graph, *args, **kwargs)
            finally:
                captures.ended()

        @functools.wraps(replay)
        def replay_graph(graph: Any, *args: Any, **kwargs: Any) -> Any:
            result = replay(graph, *args, **kwargs)
            if getattr(graph, STEP_MARK, False):
                ended = captures.replayed_step
                if ended is not None:
                    with contextlib.suppress(Exception):  # never into training
                        ended()
            return result

        wrapped = dict(zip(WRAPPED, (capture_begin, capture_end, replay_graph), strict=True))
        for name, method in wrapped.items():
            setattr(graph_class, name, method)

        def undo() -> None:
            for name, method in wrapped.items():
                if vars(graph_class).get(name) is method:
                    if name in own:
                        setattr(graph_class, name, originals[name])
                    else:
                        delattr(graph_class, name)

        self._undo.append(undo)
        if graphed_owners:
            self._wrap_make_graphed(graphed_owners)
        return True

    def _wrap_make_graphed(self, owners: Sequence[Any]) -> None:
        """Wrap `make_graphed_callables` where each of `owners` holds the first one's, so
        that it never sees distanom's hooks; nothing where there is none."""
        original = getattr(owners[0], "make_graphed_callables", None)
        if original is None:  # another torch's layout: nothing to lift hooks for
            return
        owners = [o for o in owners if vars(o).get("make_graphed_callables") is original]
        captures = self

        @functools.wraps(original)
        def make_graphed_callables(callables: Any, *args: Any, **kwargs: Any) -> Any:
            given = callables if isinstance(callables, tuple) else (callables,)
            restores = []
            for lift in list(captures.hook_lifters):
                try:
                    restores.append(lift(given))
                except Exception as err:  # never into training: the call goes ahead
                    log.warning("distanom: cannot lift its hooks for a graph (%s)", err)
            try:
                return original(callables, *args, **kwargs)
            finally:
                for restore in restores:
                    try:
                        restore()
                    except Exception as err:
                        log.warning("distanom: cannot put its hooks back (%s)", err)

        for owner in owners:
            owner.make_graphed_callables = make_graphed_callables

        def undo() -> None:
            for owner in owners:
                if vars(owner).get("make_graphed_callables") is make_graphed_callables:
                    owner.make_graphed_callables = original

        self._undo.append(undo)

    def uninstall(self) -> None:
        """Put torch's methods back (tests; the agent keeps them for the process)."""
        while self._undo:
            self._undo.pop()()
        self.capturing = 0
        self._stacks.clear()

    def began(self, graph: Any = None) -> None:
        """A capture of `graph` on this thread is about to begin: once any query holding
        the lock has returned."""
        with self.lock:
            self.capturing += 1
            self.seen += 1
            self._stacks.setdefault(threading.get_ident(), []).append(graph)
            self._skipped = 0

    def ended(self) -> None:
        """A capture ended (or failed to begin) on this thread."""
        with self.lock:
            self.capturing = max(0, self.capturing - 1)
            ident = threading.get_ident()
            stack = self._stacks.get(ident)
            if stack:
                stack.pop()
            if not stack:
                self._stacks.pop(ident, None)

    def here(self) -> bool:
        """Whether this thread is capturing a graph (its steps and marks are not run now)."""
        return threading.get_ident() in self._stacks

    def step_captured(self) -> None:
        """A step boundary came inside a capture on this thread: that graph holds the
        step, and each replay of it ends one."""
        stack = self._stacks.get(threading.get_ident())
        graph = stack[-1] if stack else None
        if graph is not None:
            with contextlib.suppress(Exception):  # a graph type without attributes
                setattr(graph, STEP_MARK, True)
        self._skipped += 1
        if self._skipped == STUCK_BOUNDARIES and not self._warned_stuck:
            self._warned_stuck = True
            log.warning(
                "distanom: %d step boundaries inside one CUDA graph capture, whose end was "
                "never seen: steps are not timed until it ends", STUCK_BOUNDARIES,
            )  # fmt: skip

    def quiet_query(self, query: Callable[[], bool], while_capturing: bool) -> bool:
        """`query()` (an event query) unless a capture is in flight, then `while_capturing`
        without calling it; for threads other than the training thread. The lock held
        elsewhere (a deferred reader's round of reads, a capture beginning) answers the
        same, rather than waiting."""
        if not self.lock.acquire(blocking=False):
            return while_capturing
        try:
            return while_capturing if self.capturing else query()
        finally:
            self.lock.release()


CAPTURES = GraphCaptures()
