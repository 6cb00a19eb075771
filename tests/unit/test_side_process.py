"""The side process (`side_frames`, `side_link`, `side_main`): a round's records cross
whole, the side process writes the same steps file as the rank would, it ends with the
rank, and when it cannot take the work (never started, killed, stuck) the rank writes
the file itself, says so once, and loses at most what was already sent."""

from __future__ import annotations

import logging
import math
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distanom import side_link
from distanom.health import Health
from distanom.phase_split import NO_RAW
from distanom.side_frames import FLUSH, OPEN, STEPS, frame, pack_steps, unpack_steps
from distanom.side_link import SideLink, SideSteps
from distanom.side_main import SideProcess
from distanom.step_log import StepLog
from distanom.step_record import StepRecord

REPO = Path(__file__).resolve().parents[2]


def record(step: int, *, marks: list[tuple[int, int, object]] | None = None) -> StepRecord:
    phases = (marks, 1_000 * step, 1_000 * step + 900, 7, (0.5, 1.25, math.nan))
    if marks is None and step % 3 == 0:
        phases = NO_RAW
    return StepRecord(step, 3.0 + step / 100, step % 4, 0.25 * (step % 2), 0.0, -1, phases)


def records(first: int, count: int) -> list[StepRecord]:
    out = []
    for step in range(first, first + count):
        marks = [(0, 1_000 * step + 10, None), (3, 1_000 * step + 800, object())]
        out.append(record(step, marks=None if step % 3 == 0 else marks))
    return out


def rows_here(tmp_path: Path, items: list[StepRecord]) -> str:
    """The steps file the rank itself writes for `items`."""
    path = run_dir(tmp_path / "here")
    log = StepLog(Health())
    log.open(path)
    log.write(items)
    log.close()
    return path.read_text()


def run_dir(path: Path) -> Path:
    """A run directory's steps file path (the directory made, as the agent's is)."""
    path.mkdir(parents=True, exist_ok=True)
    return path / "steps" / "rank0.csv"


def handed_over(steps: SideSteps) -> SideLink:
    """The side process once it has taken the file over (it says it reads a moment after
    it starts; until then the rank writes the rows)."""
    deadline = time.monotonic() + 30
    while steps.link is None:
        assert time.monotonic() < deadline, "the side process never took the file over"
        time.sleep(0.01)
        steps.flush()  # where the rank looks whether it is ready
    return steps.link


def writing_side(tmp_path: Path) -> tuple[SideSteps, Path, SideLink]:
    """A steps file in a fresh run directory, taken over by a real side process."""
    steps = SideSteps(Health(), "r0/1", use_side=True)
    path = run_dir(tmp_path / "run")
    steps.open(path)
    return steps, path, handed_over(steps)


def same(a: object, b: object) -> bool:
    """Equal, NaN equal to NaN."""
    nans = isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)
    return a == b or nans


mark = st.tuples(st.integers(0, 3), st.integers(-(2**62), 2**62), st.none())
phases = st.tuples(
    st.one_of(st.none(), st.lists(mark, max_size=6)),
    st.integers(-(2**62), 2**62),
    st.integers(-(2**62), 2**62),
    st.integers(0, 2**62),
    st.tuples(*[st.floats(allow_nan=True, allow_infinity=True)] * 3),
)
step_record = st.builds(
    StepRecord,
    st.integers(0, 2**53),
    st.floats(allow_nan=True),
    st.integers(0, 15),
    st.floats(allow_nan=True),
    st.floats(allow_nan=True),
    st.integers(-1, 2),
    phases,
)


@settings(max_examples=200, deadline=None)
@given(st.lists(step_record, max_size=20))
def test_a_rounds_records_cross_whole(items: list[StepRecord]) -> None:
    back = unpack_steps(pack_steps(items))
    assert len(back) == len(items)
    for sent, got in zip(items, back, strict=True):
        assert isinstance(got, StepRecord)
        assert all(same(a, b) for a, b in zip(sent[:6], got[:6], strict=True))
        marks, *rest = sent.phases
        got_marks, *got_rest = got.phases
        assert got_marks == (None if marks is None else [(k, ns, None) for k, ns, _ in marks])
        assert all(same(a, b) for a, b in zip(rest[:3], got_rest[:3], strict=True))
        assert all(same(a, b) for a, b in zip(rest[3], got_rest[3], strict=True))


def test_a_damaged_steps_frame_is_refused() -> None:
    payload = pack_steps(records(1, 4))
    with pytest.raises(ValueError, match="does not hold"):
        unpack_steps(payload[:-8])


def test_the_side_process_writes_the_ranks_bytes(tmp_path: Path) -> None:
    """In this process (`SideProcess.feed`), frames cut at every size."""
    items = records(1, 40)
    path = run_dir(tmp_path / "side")
    stream = frame(OPEN, os.fsencode(path)) + frame(STEPS, pack_steps(items[:25]))
    stream += frame(FLUSH, b"") + frame(STEPS, pack_steps(items[25:]))
    side = SideProcess()
    for at in range(0, len(stream), 97):  # frames arrive in pieces
        side.feed(stream[at : at + 97])
    side.close()
    assert path.read_text() == rows_here(tmp_path, items)


def test_an_unknown_frame_ends_the_side_process() -> None:
    with pytest.raises(ValueError, match="unknown kind"):
        SideProcess().feed(frame(99, b""))


def test_a_real_side_process_writes_the_file_and_exits(tmp_path: Path) -> None:
    health = Health()
    steps = SideSteps(health, "r0/1", use_side=True)
    path = run_dir(tmp_path / "run")
    steps.open(path)
    items = records(1, 300)
    steps.write(items[:10])  # before it is ready: written here
    link = handed_over(steps)
    for at in range(10, 300, 64):
        steps.write(items[at : at + 64])
    steps.flush()
    steps.close()
    assert link.process.returncode == 0
    assert path.read_text() == rows_here(tmp_path, items)


def test_off_by_config_the_rank_writes_the_file(tmp_path: Path) -> None:
    steps = SideSteps(Health(), "r0/1", use_side=False)
    path = run_dir(tmp_path / "run")
    steps.open(path)
    assert steps.link is None
    steps.write(records(1, 10))
    steps.close()
    assert path.read_text() == rows_here(tmp_path, records(1, 10))


def test_a_side_process_that_cannot_start_leaves_the_work_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(side_link.sys, "executable", str(tmp_path / "no-python"))
    steps = SideSteps(Health(), "r0/1", use_side=True)
    path = run_dir(tmp_path / "run")
    with caplog.at_level(logging.WARNING):
        steps.open(path)
    assert steps.link is None
    assert "side process not started" in caplog.text
    assert steps.state.startswith("control thread (side process not started: ")
    assert steps.cpu_ns() is None  # it never ran
    steps.write(records(1, 10))
    steps.close()
    assert path.read_text() == rows_here(tmp_path, records(1, 10))


def never_ready(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Side processes started from here on sleep and never say they read."""
    silent = tmp_path / "silent.py"
    silent.write_text("import time\ntime.sleep(60)\n")
    real_popen = subprocess.Popen

    def popen(command: list[str], **kwargs: object) -> subprocess.Popen[bytes]:
        return real_popen([sys.executable, str(silent)], **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(side_link.subprocess, "Popen", popen)


def test_a_side_process_that_never_says_ready_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    never_ready(tmp_path, monkeypatch)
    began = time.monotonic()
    with pytest.raises(OSError, match="not ready"):
        SideLink.start("r0/1", ready_timeout_s=0.5)
    assert time.monotonic() - began < 10  # stopped, not waited for


def test_a_side_process_never_ready_is_stopped_and_the_rank_writes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    never_ready(tmp_path, monkeypatch)
    monkeypatch.setattr(side_link, "READY_TIMEOUT_S", 0.3)
    steps = SideSteps(Health(), "r0/1", use_side=True)
    path = run_dir(tmp_path / "run")
    steps.open(path)
    starting = steps._starting
    assert starting is not None
    with caplog.at_level(logging.WARNING):
        steps.write(records(1, 10))  # not ready yet: here
        time.sleep(0.5)
        steps.write(records(11, 10))  # past the limit: stopped, and said
        steps.write(records(21, 10))
    assert starting.process.poll() is not None
    assert caplog.text.count("side process not started") == 1 and "not ready" in caplog.text
    steps.close()
    assert path.read_text() == rows_here(tmp_path, records(1, 30))
    assert steps.cpu_ns() is None  # it only ever started up: no figure, not "0 ms"


def test_a_killed_side_process_hands_the_work_back_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    steps, path, link = writing_side(tmp_path)
    steps.write(records(1, 50))
    steps.flush()
    deadline = time.monotonic() + 10
    while path.read_text().count("\n") < 51 and time.monotonic() < deadline:
        time.sleep(0.02)  # written by the side process
    link.process.kill()  # not reaped here: the rank finds it gone at its next write
    # its end of the socket is closed a moment after it is a zombie (the kernel may
    # defer the last close): rows sent in between are lost, as the docs say; here the
    # next write is to find it gone
    assert link._sock is not None
    hung_up = select.poll()
    hung_up.register(link._sock, select.POLLIN)
    while _alive(link.process.pid) or not hung_up.poll(10):
        assert time.monotonic() < deadline
    with caplog.at_level(logging.WARNING):
        for first in (51, 101, 151):  # training goes on; the first write finds it gone
            steps.write(records(first, 50))
    steps.close()
    assert steps.link is None
    assert caplog.text.count("its work runs in this process") == 1
    assert steps.state.startswith("control thread (side process: it ended (exit status -9")
    used = steps.cpu_ns()  # read before it was reaped: its imports at least
    assert used is not None and used[0] >= used[1] > 0
    # nothing was in flight when it died: every row, once, in order
    assert rows_of(path) == list(range(1, 201))


def test_a_stuck_side_process_is_stopped_and_its_backlog_written_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(side_link, "MAX_BACKLOG_BYTES", 64 << 10)
    monkeypatch.setattr(side_link, "STALL_S", 0.3)
    steps, path, link = writing_side(tmp_path)
    os.kill(link.process.pid, signal.SIGSTOP)  # alive, reading nothing
    try:
        with caplog.at_level(logging.WARNING):
            for first in range(1, 20_001, 100):
                steps.write(records(first, 100))
                if steps.link is None:
                    break
                time.sleep(0.01)  # a round at a time: the backlog stays untaken
    finally:
        if link.process.poll() is None:
            os.kill(link.process.pid, signal.SIGCONT)
    assert steps.link is None, "the backlog never passed its limit"
    assert link.process.wait(10) != 0  # stopped
    assert "took nothing of a" in caplog.text
    last = first + 99
    steps.write(records(last + 1, 10))
    steps.close()
    written = rows_of(path)
    # the rows no frame of which reached the side process were written here, in order
    assert written[-10:] == list(range(last + 1, last + 11))
    assert written == sorted(written) and len(written) == len(set(written))
    assert len(written) > 100


def test_a_side_process_catching_up_on_a_big_backlog_is_left_to(tmp_path: Path) -> None:
    """Rounds held up (a long stall) arrive as one write of many steps: split into
    frames, taken as the side process reads, none lost."""
    steps, path, link = writing_side(tmp_path)
    steps.write(records(1, 30_000))
    steps.close()
    assert link.down is None and link.process.returncode == 0
    assert rows_of(path) == list(range(1, 30_001))


def test_a_side_process_that_takes_too_long_at_the_end_is_stopped_and_its_rows_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(side_link, "EXIT_TIMEOUT_S", 0.5)
    steps, path, link = writing_side(tmp_path)
    steps.write(records(1, 10))
    steps.flush()
    deadline = time.monotonic() + 10
    while path.read_text().count("\n") < 11:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(link.process.pid, signal.SIGSTOP)
    first = 11
    while len(link._frames) < 3:  # a backlog it will not take
        steps.write(records(first, 100))
        first += 100
    began = time.monotonic()
    with caplog.at_level(logging.WARNING):
        steps.close()
    assert time.monotonic() - began < 5
    assert link.process.returncode is not None  # stopped, not left behind
    assert "had not taken the last rows" in caplog.text
    assert steps.state.startswith("control thread (side process: it had not taken")
    written = rows_of(path)
    assert written[:10] == list(range(1, 11)) and written[-100:] == list(range(first - 100, first))
    assert written == sorted(written) and len(written) == len(set(written))


def test_an_unforeseen_failure_at_close_stops_the_side_process_and_raises_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    steps, _path, link = writing_side(tmp_path)
    steps.write(records(1, 10))

    def broken(self: SideLink, timeout_s: float | None = None) -> bool:
        raise RuntimeError("something unforeseen")

    monkeypatch.setattr(SideLink, "finish", broken)
    with caplog.at_level(logging.WARNING):
        steps.close()  # no raise
    assert link.process.returncode is not None  # stopped, not left running
    assert "failed (something unforeseen)" in caplog.text
    assert steps.state == "control thread (side process: failed: something unforeseen)"


def test_a_socket_past_fd_1023_works(tmp_path: Path) -> None:
    """select() refuses descriptors past 1023, which a busy rank reaches."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("the descriptor limit is below 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1030:
            held.append(os.open(os.devnull, os.O_RDONLY))
        steps = SideSteps(Health(), "r0/1", use_side=True)
        path = run_dir(tmp_path / "run")
        steps.open(path)
        link = handed_over(steps)
        assert link._sock is not None and link._sock.fileno() > 1023
        steps.write(records(1, 100))
        steps.close()
        assert link.down is None and link.process.returncode == 0
        assert rows_of(path) == list(range(1, 101))
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_distanom_folder_where_the_rank_runs_is_not_the_side_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = tmp_path / "cwd" / "distanom"
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text("raise SystemExit('the planted copy')\n")
    monkeypatch.chdir(planted.parent)
    link = SideLink.start("r0/1", ready_timeout_s=30)
    assert link.finish() and link.process.returncode == 0


def test_rows_a_side_process_that_died_never_got_are_written_at_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    steps, path, link = writing_side(tmp_path)
    os.kill(link.process.pid, signal.SIGSTOP)  # reads nothing: a backlog builds
    first = 1
    while not link._frames or len(link._frames) < 3:
        steps.write(records(first, 100))
        first += 100
    last_batch = list(range(first - 100, first))
    os.kill(link.process.pid, signal.SIGKILL)
    link.process.wait(10)
    with caplog.at_level(logging.WARNING):
        steps.close()  # END finds it gone: what it never got is written here
    assert caplog.text.count("its work runs in this process") == 1
    written = rows_of(path)
    assert written[-100:] == last_batch
    assert written == sorted(written) and len(written) == len(set(written))


def test_sigterm_and_sigint_leave_the_side_process_to_the_ranks_end(tmp_path: Path) -> None:
    """A scheduler's SIGTERM reaches every process of the job: a rank that goes on
    training loses no rows for it."""
    steps, path, link = writing_side(tmp_path)
    steps.write(records(1, 30))
    link.process.terminate()
    link.process.send_signal(signal.SIGINT)
    steps.write(records(31, 30))
    steps.close()
    assert link.process.returncode == 0 and link.down is None
    assert path.read_text() == rows_here(tmp_path, records(1, 60))


PARENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from distanom.health import Health
    from distanom.side_link import SideSteps
    from distanom.step_record import StepRecord
    from distanom.phase_split import NO_RAW
    steps = SideSteps(Health(), "r0/1", use_side=True)
    steps.open(Path(sys.argv[1]))
    while steps.link is None:  # the side process takes the file over
        time.sleep(0.01)
        steps.flush()
    steps.write([StepRecord(s, 3.0, 0, 0.0, 0.0, -1, NO_RAW) for s in range(1, 21)])
    steps.flush()
    link = steps.link
    if sys.argv[2] == "held":
        # a child that holds the socket open where distanom's fork hook cannot see (a
        # descriptor copied before the fork, as a C library's own fork would keep it)
        held = os.dup(link._sock.fileno())
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        os.close(held)
    elif sys.argv[2] == "childclose":  # a forked child that unwinds through the agent's close
        steps.write([StepRecord(99, 3.0, 0, 0.0, 0.0, -1, NO_RAW)] * 4)  # in the backlog
        pid = os.fork()
        if pid == 0:
            steps.write([StepRecord(s, 3.0, 0, 0.0, 0.0, -1, NO_RAW) for s in range(500, 510)])
            steps.flush()
            steps.close()
            os._exit(0)
        print(os.waitpid(pid, 0)[1], flush=True)
    elif sys.argv[2] == "hooked":  # a DataLoader worker: distanom's fork hook runs in it
        reader, writer = os.pipe()
        if os.fork() == 0:
            os.write(writer, b"closed" if link._sock is None and link.down else b"open")
            time.sleep(60)
            os._exit(0)
        print(os.read(reader, 16).decode(), flush=True)
    print(link.process.pid, flush=True)
    if sys.argv[3] == "close":  # the rank ends as it should, its children still alive
        steps.close()
        print(link.process.returncode, flush=True)
    time.sleep(60)
    """
)


def run_parent(path: Path, child: str, end: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PARENT, str(path), child, end],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )


def rows_of(path: Path) -> list[int]:
    return [int(line.split(",")[0]) for line in path.read_text().splitlines()[1:]]


@pytest.mark.parametrize("child", ["none", "held"])
def test_the_side_process_never_outlives_its_rank(tmp_path: Path, child: str) -> None:
    """Killed at once: the socket ends, or (a child holding it) the parent check ends it."""
    path = run_dir(tmp_path / "run")
    parent = run_parent(path, child, "kill")
    try:
        assert parent.stdout is not None
        side_pid = int(parent.stdout.readline())
        parent.kill()  # the rank dies at once: no close, no flush of its own
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(side_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(side_pid), "the side process outlived its rank"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the forked child too
    assert rows_of(path) == list(range(1, 21))


def test_a_rank_that_ends_ends_its_side_process_whatever_its_children_hold(
    tmp_path: Path,
) -> None:
    path = run_dir(tmp_path / "run")
    parent = run_parent(path, "held", "close")
    try:
        assert parent.stdout is not None
        int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "0"  # it exited, told by END
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
    assert rows_of(path) == list(range(1, 21))


def test_a_forked_child_closing_the_agent_writes_nothing(tmp_path: Path) -> None:
    path = run_dir(tmp_path / "run")
    parent = run_parent(path, "childclose", "close")
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "0"  # the child ended at once
        int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "0"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
    assert rows_of(path) == [*range(1, 21), 99, 99, 99, 99]  # the parent's, once


def test_a_forked_child_lets_go_of_the_side_process(tmp_path: Path) -> None:
    parent = run_parent(run_dir(tmp_path / "run"), "hooked", "close")
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline().strip() == "closed"
    finally:
        os.killpg(parent.pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie counts as ended: it does nothing more)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_side_process_imports_nothing_heavy() -> None:
    """No torch, and no numpy or pydantic either: their imports were most of its start-up,
    and numpy's BLAS starts a thread per core in every rank's side process."""
    code = (
        "import sys, distanom.side_main, distanom.side_link; "
        "print(sorted(m for m in ('torch', 'numpy', 'pydantic', 'yaml') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("side_process", [True, False])
def test_the_agents_cost_says_where_the_rows_went(tmp_path: Path, side_process: bool) -> None:
    """status.json's `agent_cost`: who wrote the steps file, and the side process's CPU."""
    import torch

    from distanom.agent import Agent
    from distanom.config import load_config
    from distanom.world import WorldInfo

    overrides = ["tracer.backend=none", f"control.side_process={str(side_process).lower()}"]
    agent = Agent(load_config(None, overrides), WorldInfo.from_env({}), tmp_path / "runs")
    agent.install()
    layer = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    try:
        deadline = time.monotonic() + 30
        steps = 0
        while steps < 200 or (side_process and agent.control.step_log.link is None):
            assert time.monotonic() < deadline
            layer(torch.ones(2, 4)).sum().backward()
            optimizer.step()
            time.sleep(0.002)
            steps += 1
        cost = agent.own_cost()
    finally:
        agent.close()
    if side_process:
        assert cost["steps_written_by"] == "side process"
        # its start-up (interpreter, imports) apart; the rows after it: /proc counts in
        # ticks of 10 ms, so 200 steps' rows may read as none
        assert cost["side_process_startup_cpu_ms"] > 0
        assert isinstance(cost["side_process_cpu_us_per_step"], float)
    else:
        assert cost["steps_written_by"] == "control thread (control.side_process off)"
        assert cost["side_process_cpu_us_per_step"] is None
        assert cost["side_process_startup_cpu_ms"] is None
