"""Where a step's time went, on the training thread: the phases of every step (data,
forward, backward, optimizer), timed on the host and, where the job uses CUDA, on the GPU.

Marks are taken at points every training loop passes, with no change to the script:

- the batch fetch: `DataLoader` iterators' `__next__` (the time inside it is summed per
  step as `fetch`, whatever phase it falls in);
- the model's outermost forward, start and end: torch's global module hooks run only
  until the outermost module is known (of the modules called with no other module
  running by the first step end, the one with parameters that took longest: a loss
  module is passed over), then
  hooks on that instance alone (global hooks take every module off its fast call path),
  lifted while the script passes the model to `make_graphed_callables`, which refuses a
  hooked module (`distanom.graph_capture`); inside a CUDA graph capture no mark is taken;
- the end of `torch.autograd.backward` (`loss.backward()`): the host has launched the
  backward pass; what follows until the optimizer step is the loop's own work there
  (gradient clipping, a GradScaler's inf check, which synchronizes);
- the counted optimizer's `step()` start (`StepBoundaries` calls `optimizer_started`) and
  the step boundary.

Each step's host time is split into parts by the mark that opens each interval (and
the one that closes it): `data` (from the last boundary to the first forward; between
micro-batches, from a backward's end to the next forward), `forward`, `backward` (from a
forward's end to the backward's end), `tail` (from the backward's end to the optimizer
step: reported as part of the backward phase) and `optimizer`. Lightning runs the
forward and backward inside `optimizer.step(closure)`: after an optimizer start, a
backward's end opens `optimizer` again. With CUDA, the forward's end and the backward's
end also record a pooled CUDA event on the current stream (two events a step: each costs
the training thread a few us, bench/results/phase_marks_cost_*), which split the GPU's
time into three `GPU_PARTS`: up to the forward's end (data and forward), the backward,
and after it (tail and optimizer). A GPU part that grew while the host's time for the
same span did not is device work that grew, also where the host then spin-waited for it
in a synchronize (docs/evidence.md).

The parts of a step are handed out by `take_raw(step)` once the step clock has timed the
step (the boundary events have completed, so every earlier phase event has too: no
synchronize): the GPU parts read there, the host marks as they are, split into parts
(`phase_split`) where the step's row of steps/rank<R>.csv is written, the side process
or the control thread (`take` does both, for tools); the report reads them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distanom.graph_capture import CAPTURES
from distanom.own_time import CPU_SAMPLE_EVERY
from distanom.phase_split import (
    _BWD_END,
    _FWD_END,
    _FWD_START,
    _OPT_START,
    NAN_GPU,
    NO_RAW,
    PhaseTimes,
    RawPhases,
    resolve,
    split_gpu,
)
from distanom.phase_split import told as _told

log = logging.getLogger(__name__)

MAX_MARKS = 256  # marks kept per step (a loop of many micro-batches keeps its first ones)
RECORD_WALLS_KEPT = 256  # sampled event records kept, whose median is `record_floor_us`
MAX_KEPT_STEPS = 2048  # steps whose parts wait for the clock (it gives up beyond)
MAX_TOP_MODULES = 64  # outermost modules remembered while looking for the model
FIND_MODEL_BOUNDARIES = 3  # step ends with global hooks before giving up on a model


def _has_parameters(module: Any) -> bool:
    try:
        return next(iter(module.parameters()), None) is not None
    except Exception:  # a module whose parameters() misbehaves is not the model
        return False


class PhaseMarks:
    """The phase marks of one rank's training thread; see the module docstring.

    `install()` sets the hooks, `uninstall()` undoes every one; `step_ended(step, ns)`
    at each boundary; `take(step)` once the step's time is known. Never raises into
    training: a failing hook switches phases off (logged once)."""

    def __init__(self, *, gpu_calls: Any = None) -> None:
        self._marks: list[tuple[int, int, Any]] = []  # (kind, perf ns, event or None)
        self._fetch_ns = 0
        self._last_boundary_ns: int | None = None
        self._last_boundary_event: Any = None
        self._kept: dict[int, tuple[Any, ...]] = {}  # step -> what `take_raw` needs
        self._undo: list[Callable[[], None]] = []
        self._model_hooks: list[Any] = []
        self._model: weakref.ref[Any] | None = None  # the hooked model
        self._top: dict[int, list[Any]] = {}  # id -> [module ref, total ns, depth-0 calls]
        self._depth = 0
        self._entered_ns = 0
        self._in_model = 0
        self._backward_depth = 0
        self._boundaries = 0
        self._calls = gpu_calls  # CudaEventCalls, or None: host parts only
        self._spare: list[Any] = []
        self._stream_key: Any = None
        self._stream: Any = None
        self._global: list[Any] = []
        self.own_ns = 0  # the marks' own time between boundaries (event records mostly)
        # the event records inside it: their wall time and count, and the walls of the
        # sampled steps' records (their median: `record_floor_us`, `queue_waits_ns`)
        self.record_ns = 0
        self.records = 0
        self.record_walls: collections.deque[int] = collections.deque(maxlen=RECORD_WALLS_KEPT)
        # the marks of every CPU_SAMPLE_EVERY-th step: this thread's CPU and wall time in
        # them (`own_time`: wall time holds GIL and launch-queue waits)
        self.cpu_sample = [0, 0]
        self._sampling = False
        self.model_name: str | None = None
        self.off = False
        self.note = ""

    # -- hooks ------------------------------------------------------------------------

    def install(self) -> None:
        """Wrap the batch fetch and the backward call; look for the model (global
        module hooks until the first step ends)."""
        try:
            self._wrap_fetch()
            self._wrap_backward()
            from torch.nn.modules import module as nn_module

            pre = nn_module.register_module_forward_pre_hook(self._global_pre)
            post = nn_module.register_module_forward_hook(self._global_post)
            self._global = [pre, post]
            CAPTURES.hook_lifters.append(self._lift_hooks)
        except Exception as err:  # another torch's layout: no phases, training goes on
            self._switch_off(f"phase marks cannot be set ({err})")

    def uninstall(self) -> None:
        """Undo every hook and wrapper (at close)."""
        self._drop_global_hooks()
        self._drop_model_hooks()
        with contextlib.suppress(ValueError):
            CAPTURES.hook_lifters.remove(self._lift_hooks)
        while self._undo:
            self._undo.pop()()

    def use_gpu(self, calls: Any) -> None:
        """Record a CUDA event at each mark from now on (`clock.CudaEventCalls`)."""
        self._calls = calls

    def _wrap_fetch(self) -> None:
        from torch.utils.data import dataloader

        owner: Any = dataloader._BaseDataLoaderIter
        original = owner.__dict__["__next__"]
        marks = self

        @functools.wraps(original)
        def __next__(iterator: Any) -> Any:
            began = time.perf_counter_ns()
            try:
                return original(iterator)
            finally:
                marks._fetch_ns += time.perf_counter_ns() - began

        owner.__next__ = __next__

        def undo() -> None:
            if owner.__dict__.get("__next__") is __next__:
                owner.__next__ = original

        self._undo.append(undo)

    def _wrap_backward(self) -> None:
        autograd = torch.autograd
        original = autograd.backward
        marks = self

        @functools.wraps(original)
        def backward(*args: Any, **kwargs: Any) -> Any:
            marks._backward_depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                marks._backward_depth -= 1
                if not marks._backward_depth:  # a nested call (checkpointing) is inside
                    marks._mark(_BWD_END)

        autograd.backward = backward

        def undo() -> None:
            if autograd.backward is backward:
                autograd.backward = original

        self._undo.append(undo)

    def _global_pre(self, module: Any, _args: Any) -> None:
        if not self._depth:
            self._entered_ns = time.perf_counter_ns()
        self._depth += 1

    def _global_post(self, module: Any, _args: Any, _out: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        seen = self._top.get(id(module))
        if seen is None:
            if len(self._top) >= MAX_TOP_MODULES:
                return
            seen = self._top[id(module)] = [weakref.ref(module), 0, 0]
        seen[1] += time.perf_counter_ns() - self._entered_ns
        seen[2] += 1

    def _drop_global_hooks(self) -> None:
        for handle in self._global:
            handle.remove()
        self._global = []

    def _find_model(self) -> None:
        """At a step end while looking: the outermost module that took longest is the
        model; hooks move onto that instance."""
        self._boundaries += 1
        alive = [(entry[1], entry[0]()) for entry in self._top.values()]
        found = [(total, module) for total, module in alive if module is not None]
        if not found and self._boundaries < FIND_MODEL_BOUNDARIES:
            return
        self._drop_global_hooks()
        self._top = {}
        if not found:
            self._say("no nn.Module was called before the step ended: the data, forward and "
                      "backward phases are not told apart (the optimizer phase and the "
                      "batch fetch are)")  # fmt: skip
            return
        # a loss or activation module has no parameters: the model is one that does
        with_params = [item for item in found if _has_parameters(item[1])]
        model = max(with_params or found, key=lambda item: item[0])[1]
        self.model_name = type(model).__name__
        self._model = weakref.ref(model)
        self._hook_model(model)

    def _hook_model(self, model: Any) -> None:
        self._model_hooks = [
            model.register_forward_pre_hook(self._model_pre),
            model.register_forward_hook(self._model_post),
        ]

    def _drop_model_hooks(self) -> None:
        for handle in self._model_hooks:
            handle.remove()
        self._model_hooks = []

    def _lift_hooks(self, given: Sequence[Any]) -> Callable[[], None]:
        """`make_graphed_callables` refuses a module with forward hooks: if the hooked
        model is among the modules `given` to it, its hooks come off; returns what puts
        them back (torch allows hooks added after, distanom.graph_capture)."""
        model = self._model() if self._model is not None else None
        if model is None or not self._model_hooks or not any(m is model for m in given):
            return _nothing
        self._drop_model_hooks()

        def restore() -> None:
            if not self.off and not self._model_hooks:
                self._hook_model(model)

        return restore

    def _model_pre(self, _module: Any, _args: Any) -> None:
        self._in_model += 1
        if self._in_model == 1:
            self._mark(_FWD_START)

    def _model_post(self, _module: Any, _args: Any, _out: Any) -> None:
        self._in_model = max(0, self._in_model - 1)
        if not self._in_model:
            self._mark(_FWD_END)

    def optimizer_started(self) -> None:
        """The counted optimizer's step() was entered (from its wrapper)."""
        self._mark(_OPT_START)

    def _mark(self, kind: int) -> None:
        marks = self._marks
        if self.off or len(marks) >= MAX_MARKS or (CAPTURES.capturing and CAPTURES.here()):
            return  # inside a CUDA graph capture nothing runs now (distanom.graph_capture)
        now = time.perf_counter_ns()
        sampling = self._sampling
        cpu_began = time.thread_time_ns() if sampling else 0
        event = None
        calls = self._calls
        if calls is not None and kind in (_FWD_END, _BWD_END):
            try:
                key = calls.stream_key()
                if key != self._stream_key:  # a Stream object made only when it changes
                    self._stream_key, self._stream = key, calls.stream_of(key)
                event = self._spare.pop() if self._spare else calls.new_event()
                recording = time.perf_counter_ns()
                calls.record(event, self._stream)
                recorded = time.perf_counter_ns() - recording
                self.record_ns += recorded
                self.records += 1
                if sampling:
                    self.record_walls.append(recorded)
            except Exception as err:
                self._calls = None
                self._say(f"phase events failed ({err}); phases are timed on the host only")
                event = None
        marks.append((kind, now, event))
        took = time.perf_counter_ns() - now
        self.own_ns += took
        if sampling:
            sample = self.cpu_sample
            sample[0] += time.thread_time_ns() - cpu_began
            sample[1] += took

    # -- at boundaries -----------------------------------------------------------------

    def step_ended(self, step: int, boundary_ns: int, boundary_event: Any = None) -> None:
        """Boundary `step` (perf_counter_ns, and the clock's CUDA event there, if any):
        the step's host parts are kept until `take(step)`."""
        if self.off:
            return
        try:
            self._step_ended(step, boundary_ns, boundary_event)
        except Exception as err:  # never into training: phases step aside
            self._switch_off(f"phase bookkeeping failed ({err}); phases are off")

    def _step_ended(self, step: int, boundary_ns: int, boundary_event: Any) -> None:
        # as little as can be here: the host parts are split by `resolve`, on the
        # control thread; the GPU parts are read at `take_raw`
        if self._global:
            self._find_model()
        self._sampling = not (step + 1) % CPU_SAMPLE_EVERY  # the next step's marks
        marks, self._marks = self._marks, []
        fetch_ns, self._fetch_ns = self._fetch_ns, 0
        start, start_event = self._last_boundary_ns, self._last_boundary_event
        self._last_boundary_ns, self._last_boundary_event = boundary_ns, boundary_event
        if start is None:
            self._recycle(marks)
            return
        kept = self._kept
        kept[step] = (marks, start, boundary_ns, fetch_ns, start_event, boundary_event)
        if len(kept) > MAX_KEPT_STEPS:
            try:
                oldest = next(iter(kept))
            except RuntimeError:  # a deferred clock's reader popped meanwhile: next time
                return
            dropped = kept.pop(oldest, None)
            if dropped is not None:
                self._recycle(dropped[0])

    def take(self, step: int) -> PhaseTimes:
        """The step's (host parts, fetch ms, GPU parts), NaN where not known; call once
        its boundary event has completed (the clock timed it)."""
        return resolve(self.take_raw(step))

    def take_raw(self, step: int) -> RawPhases:
        """`take`'s answer before the host parts are split (`resolve` does that, off the
        training thread); the GPU parts are read here, the events then reused."""
        kept = self._kept.pop(step, None)
        if kept is None:
            return NO_RAW
        marks, start, end, fetch_ns, start_event, end_event = kept
        gpu_parts = NAN_GPU
        if self._calls is not None:
            if start_event is not None and end_event is not None and _told(marks):
                try:
                    gpu_parts = self._gpu_parts(start_event, marks, end_event)
                except Exception as err:  # an event of another device, a torch change
                    self._calls = None
                    self._say(f"phase events unreadable ({err}); phases are timed on the host only")
            self._recycle(marks)
        return marks, start, end, fetch_ns, gpu_parts

    def _gpu_parts(self, start_event: Any, marks: list[Any], end_event: Any) -> tuple[float, ...]:
        """The GPU's three parts (ms) between the step's boundary events, split at the
        events of the forward's and backward's ends (`split_gpu`)."""
        elapsed = self._calls.elapsed_ms
        timed = [(kind, event) for kind, _ns, event in marks if event is not None]
        if not timed:
            return NAN_GPU
        at, position = [], 0.0
        previous = start_event
        for kind, event in timed:
            position += float(elapsed(previous, event))
            at.append((kind, position))
            previous = event
        return split_gpu(at, position + float(elapsed(previous, end_event)))

    def _recycle(self, marks: list[tuple[int, int, Any]]) -> None:
        spare = self._spare
        for _kind, _ns, event in marks:
            if event is not None and len(spare) < MAX_MARKS:
                spare.append(event)

    def queue_waits_ns(self) -> tuple[int, float | None]:
        """How much of `own_ns` the event records took beyond their usual wall, and that
        wall (us): the median of the sampled records' walls. Beyond it a record waited,
        for a CUDA launch-queue slot or for the GIL it let go, or ran slow (jitter;
        `own_time` gives it beside the marks' figure; control thread: the walls are
        copied in one C call). (0, None) before a sample."""
        walls = sorted(list(self.record_walls))
        if not walls:
            return 0, None
        floor = walls[len(walls) // 2]
        return max(0, self.record_ns - self.records * floor), floor / 1e3

    def _switch_off(self, why: str) -> None:
        self.off = True
        self._say(why)
        self.uninstall()

    def _say(self, what: str) -> None:
        if not self.note:
            self.note = what
            log.warning("distanom: %s", what)


def _nothing() -> None:
    return None
