"""CaptureWorker against a tracer whose steps can vanish between two calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from distanom import rundir
from distanom.capture import CaptureWorker
from distanom.config import load_config
from distanom.detect import CaptureDecision
from distanom.health import Health
from distanom.records.index import read_index
from distanom.rundir import RunDir, create_run
from distanom.tracers.base import Availability, StepTrace
from distanom.world import WorldInfo


def warn() -> Callable[..., None]:
    """A fresh rank's warning (the agent's, no run directory set: once per key)."""
    return Health().warn_write_failed


class VanishingTracer:
    """READY when asked, gone when read: the step aged out of the history in between."""

    name = "vanishing"

    def __init__(self) -> None:
        self.reads = 0

    def availability(self, step: int) -> Availability:
        return Availability.READY

    def step_trace(self, step: int) -> StepTrace:
        self.reads += 1
        if step == 5:
            raise KeyError(f"step {step} is gone: older than history_steps")
        return StepTrace(step=step, events=[], base_time_ns=0, metadata={}, stats={})


def decision(step: int) -> CaptureDecision:
    return CaptureDecision(step, "anomaly", 30.0, 10.0, 15.0, slowest_rank=0)


def test_a_step_gone_between_two_calls_is_missed_and_capture_goes_on(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "race"))
    config = load_config(None, ["analysis.on_capture=report"])
    tracer = VanishingTracer()
    worker = CaptureWorker(
        run, WorldInfo.from_env({}), tracer, config, tracer_name="vanishing", warn=warn()
    )
    worker.submit([decision(5), decision(9)])
    deadline = time.monotonic() + 10
    while tracer.reads < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    worker.close(5.0)
    assert worker.active, worker.stats.failed
    assert worker.stats.missed == 1 and worker.stats.missed_steps == [5]
    assert run.trace_path(9, 0).exists() and not run.trace_path(5, 0).exists()


# -- replaced captures: several ranks share one captures/step_N folder -----------------


class ReadyTracer:
    """Every step READY, except those in `pending` (the tracer's window is still open)."""

    name = "ready"

    def __init__(self, pending: set[int] | None = None) -> None:
        self.pending = pending or set()

    def availability(self, step: int) -> Availability:
        return Availability.PENDING if step in self.pending else Availability.READY

    def step_trace(self, step: int) -> StepTrace:
        events = [{"name": f"distanom step {step}", "ph": "X", "ts": 0, "dur": 1}]
        return StepTrace(step=step, events=events, base_time_ns=0, metadata={}, stats={})


def reference(step: int, replaces: int | None = None) -> CaptureDecision:
    return CaptureDecision(step, "reference", 10.0, 10.0, 15.0, slowest_rank=0, replaces=replaces)


def anomaly(step: int, ratio: float, replaces: int | None = None) -> CaptureDecision:
    return CaptureDecision(
        step, "anomaly", 10.0 * ratio, 10.0, 15.0, slowest_rank=0, replaces=replaces
    )


def rank_worker(run: RunDir, rank: int, world: int, tracer: object | None = None) -> CaptureWorker:
    config = load_config(None, ["analysis.on_capture=report"])
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    return CaptureWorker(
        run,
        WorldInfo.from_env(env),
        tracer or ReadyTracer(),
        config,
        tracer_name="ready",
        warn=warn(),
    )


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def step_dirs(run: RunDir) -> dict[int, list[str]]:
    root = run.path / "captures"
    return {
        int(child.name.removeprefix("step_")): sorted(p.name for p in child.iterdir())
        for child in sorted(root.iterdir())
    }


def test_replaced_reference_folder_goes_once_the_last_rank_is_out(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "refs"))
    workers = [rank_worker(run, rank, 4) for rank in range(4)]
    for worker in workers:
        worker.submit([reference(26)])
    wait_for(lambda: all(run.trace_path(26, rank).exists() for rank in range(4)))
    # tables computed beside rank 0's trace (CPU-only: cpu_timeline.csv) go with it
    (run.capture_dir(26) / "rank0.cpu_timeline.csv").write_text("type,time ms,percent\n")

    # rank 0 moves on to the newer reference first: ranks 1-3 still hold step 26
    workers[0].submit([reference(68, replaces=26)])
    wait_for(lambda: run.trace_path(68, 0).exists())
    wait_for(lambda: workers[0].stats.dropped == 1)
    assert step_dirs(run)[26] == [f"rank{r}.trace.json.gz" for r in (1, 2, 3)]

    for worker in workers[1:]:
        worker.submit([reference(68, replaces=26)])
    for worker in workers:
        worker.submit([reference(108, replaces=68)])
        worker.close(5.0)
        assert worker.active, worker.stats.failed
        # 68 may be skipped by ranks that saw 108 replace it in the same pass
        assert worker.stats.written - worker.stats.dropped == 1
    assert step_dirs(run) == {108: [f"rank{r}.trace.json.gz" for r in range(4)]}
    records, problems = read_index(run)
    assert problems == []
    events = [r.event for r in records]
    assert events.count("written") - events.count("dropped") == 4


def test_budget_replacement_removes_the_least_severe_folder(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "budget"))
    workers = [rank_worker(run, rank, 2) for rank in range(2)]
    for worker in workers:
        worker.submit([anomaly(40, 3.0), anomaly(75, 2.0), anomaly(90, 6.0, replaces=75)])
    for worker in workers:
        worker.close(5.0)
        assert worker.active, worker.stats.failed
    assert sorted(step_dirs(run)) == [40, 90]


def test_a_capture_replaced_while_pending_here_is_never_written(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "pending"))
    tracer = ReadyTracer(pending={26})
    worker = rank_worker(run, 0, 1, tracer)
    worker.submit([reference(26), reference(68, replaces=26)])
    wait_for(lambda: run.trace_path(68, 0).exists())
    tracer.pending.clear()  # step 26 becomes readable only now
    worker.close(5.0)
    assert worker.active, worker.stats.failed
    assert worker.stats.written == 1
    assert step_dirs(run) == {68: ["rank0.trace.json.gz"]}


def test_a_write_that_fails_leaves_no_empty_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunDir(create_run(tmp_path, "fail"))

    def full_disk(folder: int, name: str, data: bytes, mode: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rundir, "write_atomic_at", full_disk)
    worker = rank_worker(run, 0, 1)
    worker.submit([reference(26)])
    worker.close(5.0)
    # the failure is counted and said; capture stays on for the next one
    assert worker.active and worker.stats.errors == 1
    assert "No space left" in str(worker.stats.last_error)
    assert step_dirs(run) == {}


class CountingTracer(ReadyTracer):
    """ReadyTracer that remembers which steps were read (built into a trace); reading
    step `hold` waits for `release`, so the worker is busy while more decisions queue."""

    def __init__(self, pending: set[int] | None = None, hold: int | None = None) -> None:
        super().__init__(pending)
        self.read: list[int] = []
        self.hold = hold
        self.release = threading.Event()

    def step_trace(self, step: int) -> StepTrace:
        self.read.append(step)
        if step == self.hold:
            self.release.wait(10)
        return super().step_trace(step)


def test_a_capture_replaced_in_the_same_pass_is_never_built(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "same-pass"))
    tracer = CountingTracer(hold=5)
    worker = rank_worker(run, 0, 1, tracer)
    worker.submit([anomaly(5, 3.0)])
    wait_for(lambda: tracer.read == [5])  # the worker is busy writing step 5
    worker.submit([reference(26), reference(68, replaces=26)])  # both READY, one pass
    tracer.release.set()
    worker.close(5.0)
    assert worker.active, worker.stats.failed
    assert tracer.read == [5, 68] and worker.stats.written == 2
    assert sorted(step_dirs(run)) == [5, 68]


def test_a_skipped_replacement_still_drops_what_it_replaced(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "chain"))
    tracer = CountingTracer()
    worker = rank_worker(run, 0, 1, tracer)
    worker.submit([reference(26)])
    wait_for(lambda: run.trace_path(26, 0).exists())
    tracer.pending.update({68, 111})
    worker.submit([reference(68, replaces=26), reference(111, replaces=68)])
    time.sleep(0.3)
    tracer.pending.clear()
    worker.close(5.0)
    assert worker.active, worker.stats.failed
    assert tracer.read == [26, 111]
    assert step_dirs(run) == {111: ["rank0.trace.json.gz"]}


def test_what_a_report_wrote_does_not_keep_a_replaced_folder(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "live-report"))
    worker = rank_worker(run, 0, 1)
    worker.submit([reference(26)])
    wait_for(lambda: run.trace_path(26, 0).exists())
    # `distanom report` ran on the live job: its outputs sit beside the rank's trace
    (run.capture_dir(26) / "summary.json").write_text("{}")
    (run.capture_dir(26) / "merged.trace.json.gz").write_bytes(b"x")
    worker.submit([reference(68, replaces=26)])
    worker.close(5.0)
    assert worker.active, worker.stats.failed
    assert sorted(step_dirs(run)) == [68]


def test_report_outputs_stay_while_a_rank_file_is_still_there(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "live-report-2"))
    folder = run.capture_dir(26)
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text("{}")
    (folder / "rank1.trace.json.gz").write_bytes(b"x")
    assert run.remove_capture_dir_if_empty(26) is False
    assert sorted(p.name for p in folder.iterdir()) == ["rank1.trace.json.gz", "summary.json"]


def test_a_folder_that_keeps_vanishing_misses_one_capture_not_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = RunDir(create_run(tmp_path, "contended"))
    attempts: list[Path] = []

    def removed_under_us(folder: int, name: str, data: bytes, mode: int) -> None:
        attempts.append(Path(name))
        raise FileNotFoundError(2, "No such file or directory", name)

    monkeypatch.setattr(rundir, "write_atomic_at", removed_under_us)
    worker = rank_worker(run, 0, 1)
    worker.submit([reference(26)])
    worker.close(5.0)
    assert worker.active, worker.stats.failed
    assert worker.stats.missed == 1 and worker.stats.written == 0
    assert len(attempts) == rundir.CAPTURE_DIR_ATTEMPTS


def test_a_replaced_kind_leaves_the_report_when_another_kind_keeps_the_file(
    tmp_path: Path,
) -> None:
    from distanom.analysis.run import load_run

    run = RunDir(create_run(tmp_path, "labels"))
    worker = rank_worker(run, 0, 1)
    requested = CaptureDecision(40, "requested", 30.0, 10.0, 15.0, slowest_rank=0)
    worker.submit([anomaly(40, 3.0)])
    wait_for(lambda: run.trace_path(40, 0).exists())
    worker.submit([requested])
    worker.submit([anomaly(90, 6.0, replaces=40)])
    worker.close(5.0)
    assert worker.active, worker.stats.failed
    kinds = {info.step: info.kinds for info in load_run(str(run.path)).captures}
    assert kinds == {40: {"requested"}, 90: {"anomaly"}}


class SlowLookupTracer(ReadyTracer):
    """Finding step 7 takes `lookup_s` (the cupti tracer indexing buffers); step 8 is a
    quick poll that stays PENDING."""

    def __init__(self, lookup_s: float) -> None:
        super().__init__(pending={8})
        self.lookup_s = lookup_s

    def availability(self, step: int) -> Availability:
        if step == 7:
            time.sleep(self.lookup_s)
        return super().availability(step)


def test_a_heavy_lookup_is_charged_to_the_steps_a_quick_poll_is_not(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "cost"))
    tracer = SlowLookupTracer(0.03)
    worker = rank_worker(run, 0, 1, tracer)
    worker.submit([decision(8)])
    time.sleep(0.3)  # several polls of the pending step
    assert worker.busy_ns() == 0
    worker.submit([decision(7)])
    wait_for(lambda: run.trace_path(7, 0).exists())
    worker.close(0.1)
    assert worker.busy_ns() >= 30_000_000  # the lookup, and the build and write after it
    written = [r for r in read_index(run)[0] if r.event == "written"]
    assert [r.step for r in written] == [7]
    cost = written[0].raw["cost_ms"]
    assert set(cost) == {
        "locate_ms", "lookups", "build_ms", "encode_ms", "write_ms", "paused_ms"
    }  # fmt: skip
    assert cost["lookups"] == 1
    assert cost["locate_ms"] >= 30.0


def test_documents_encode_with_orjson_and_fall_back_for_what_it_refuses() -> None:
    import json

    from distanom.capture import encode_document

    document = {"traceEvents": [{"name": "k", "ph": "X", "ts": 1.5, "dur": 2}], "n": 3}
    assert json.loads(encode_document(document)) == document
    wide = {"traceEvents": [], "id": 1 << 70}  # past orjson's 64 bits: json.dumps writes it
    assert json.loads(encode_document(wide)) == wide


def test_a_sliced_encode_is_the_same_json_with_the_gil_dropped_between_slices() -> None:
    import json

    from distanom.capture import encode_document

    events = [{"name": f"k{i}", "ph": "X", "ts": i + 0.5, "dur": 1} for i in range(2500)]
    info = {"rank": 1, "world_size": 2}
    document = {"distributedInfo": info, "schemaVersion": 1, "traceEvents": events}
    pauses: list[int] = []
    sliced = encode_document(document, lambda: pauses.append(1), 256)
    assert json.loads(sliced) == document
    assert sliced.startswith(b'{"distributedInfo": {"rank": 1')  # HTA's rank pattern first
    assert len(pauses) == 9  # 10 slices of 256 events (the last 196)
    assert sliced == encode_document(document)  # byte for byte, events last
    alone = {"distributedInfo": info, "traceEvents": events}
    assert encode_document(alone, lambda: None, 256) == encode_document(alone)
    # a small trace, or no pause given: one piece, as before
    assert encode_document(document) == encode_document(document, None)
    few = {"traceEvents": events[:10]}
    assert encode_document(few, lambda: pauses.append(1), 256) == encode_document(few)
    assert len(pauses) == 9
    # nothing but the events: no stray comma
    only = {"traceEvents": events}
    assert json.loads(encode_document(only, lambda: None, 256)) == only


class ManyEventsTracer(ReadyTracer):
    def step_trace(self, step: int) -> StepTrace:
        events = [{"name": f"k{i}", "ph": "X", "ts": i, "dur": 1} for i in range(5000)]
        return StepTrace(step=step, events=events, base_time_ns=0, metadata={}, stats={})


def test_a_large_capture_pauses_between_slices_and_the_pauses_are_not_busy_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distanom import capture

    monkeypatch.setattr(capture, "slice_pause_s", lambda median_ms: 0.05)
    run = RunDir(create_run(tmp_path, "paced"))
    worker = rank_worker(run, 0, 1, ManyEventsTracer())
    began = time.monotonic_ns()
    worker.submit([decision(7)])
    wait_for(lambda: bool(read_index(run)[0]))
    worker.close(1.0)
    took = time.monotonic_ns() - began  # busy time and pauses are disjoint parts of it
    # one pause before the encode, one between each two of its slices: 5,000 events at
    # 250 a median step's ms (10 ms: 2,500 a slice)
    assert worker.paused_ns >= 2 * 50_000_000
    assert worker.busy_ns() <= took - worker.paused_ns
    [written] = read_index(run)[0]
    assert written.raw["cost_ms"]["paused_ms"] >= 100.0
    assert written.raw["cost_ms"]["encode_ms"] < 100.0


def test_every_ready_step_is_taken_from_the_tracer_before_any_is_written(
    tmp_path: Path,
) -> None:
    """A paced write takes many steps; a second step of the same batch may leave the
    tracer's history meanwhile, so its events are taken first."""
    run = RunDir(create_run(tmp_path, "prefetch"))
    written_before: dict[int, int] = {}

    class CountingTracer(ManyEventsTracer):
        def step_trace(self, step: int) -> StepTrace:
            written_before[step] = len(read_index(run)[0])
            return super().step_trace(step)

    worker = rank_worker(run, 0, 1, CountingTracer())
    worker.submit([decision(7), decision(9), reference(7)])
    wait_for(lambda: len(read_index(run)[0]) >= 3)
    worker.close(1.0)
    assert written_before == {7: 0, 9: 0}  # step 7's second kind: no second read
    records = read_index(run)[0]
    assert sorted((r.step, r.kind) for r in records) == [
        (7, "anomaly"), (7, "reference"), (9, "anomaly")
    ]  # fmt: skip
    assert run.trace_path(7, 0).exists() and run.trace_path(9, 0).exists()


def test_a_long_lookup_counts_while_it_runs(tmp_path: Path) -> None:
    run = RunDir(create_run(tmp_path, "cost"))
    tracer = SlowLookupTracer(0.3)
    worker = rank_worker(run, 0, 1, tracer)
    worker.submit([decision(7)])
    time.sleep(0.15)  # halfway through the lookup: the steps it overlaps are charged now
    assert worker.busy_ns() >= 50_000_000
    wait_for(lambda: run.trace_path(7, 0).exists())
    worker.close(0.1)
    assert worker.busy_ns() >= 300_000_000


def test_numpy_numbers_encode_without_the_slow_path() -> None:
    import json

    import numpy as np

    from distanom.capture import encode_document

    document = {"ts": np.float64(1.5), "n": np.int64(3), "bad": float("nan")}
    assert json.loads(encode_document(document)) == {"ts": 1.5, "n": 3, "bad": None}


class FutureTracer(ReadyTracer):
    """Steps up to 40 ended and are held; later ones have not come (yet)."""

    last_ready_at = 0.0  # step 40 is PENDING until then

    def availability(self, step: int) -> Availability:
        if step < 40 or (step == 40 and time.monotonic() >= self.last_ready_at):
            return Availability.READY
        return Availability.PENDING


def test_a_step_training_never_reached_does_not_hold_up_the_exit(tmp_path: Path) -> None:
    # a request for steps after training's end (an on-demand capture, a straggler's trace)
    run = RunDir(create_run(tmp_path, "ended"))
    config = load_config(None, ["analysis.on_capture=report"])
    tracer = FutureTracer()
    worker = CaptureWorker(
        run, WorldInfo.from_env({}), tracer, config, tracer_name="f", warn=warn()
    )
    tracer.last_ready_at = time.monotonic() + 0.3  # the last ended step, still being written
    worker.submit([decision(38), decision(40), decision(45)])
    began = time.monotonic()
    worker.close(5.0, last_ended_step=40)
    assert time.monotonic() - began < 2.0  # not the 5 s it waited for step 45 before
    assert worker.stats.missed_steps == [45]
    assert run.trace_path(38, 0).exists() and run.trace_path(40, 0).exists()
    # without knowing where training ended, a pending step is waited for until the timeout
    other = RunDir(create_run(tmp_path, "unknown"))
    worker = CaptureWorker(
        other, WorldInfo.from_env({}), FutureTracer(), config, tracer_name="f", warn=warn()
    )
    worker.submit([decision(45)])
    began = time.monotonic()
    worker.close(0.5)
    assert time.monotonic() - began >= 0.5 and worker.stats.missed_steps == [45]


def test_a_full_disk_budget_skips_the_encode_and_counts_the_capture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from distanom import capture

    encoded: list[int] = []
    real = capture.encode_document

    def counted(document: dict[str, Any], *args: Any) -> bytes:
        if args:  # the worker's call (with its pause), not the head's inside it
            encoded.append(1)
        return real(document, *args)

    monkeypatch.setattr(capture, "encode_document", counted)
    run = RunDir(create_run(tmp_path, "budget"))
    config = load_config(None, ["analysis.on_capture=report", "capture.max_disk_mb=0.001"])
    worker = CaptureWorker(
        run, WorldInfo.from_env({}), ManyEventsTracer(), config, tracer_name="ready", warn=warn()
    )
    worker.submit([decision(7)])  # ~40 kB compressed: over the 1 kB budget after its encode
    wait_for(lambda: worker.stats.skipped_disk == 1)
    worker.stats.bytes_written = worker._max_bytes  # the budget reached by earlier captures
    worker.submit([decision(9)])
    wait_for(lambda: worker.stats.skipped_disk == 2)
    worker.close(1.0)
    assert encoded == [1]  # the second capture was never encoded
    assert not run.trace_path(7, 0).exists() and not run.trace_path(9, 0).exists()
