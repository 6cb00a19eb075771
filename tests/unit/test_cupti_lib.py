"""The ctypes binding and the buffer pool, on CPU.

The pool is tested directly. The binding runs against `fake_libcupti.c` (compiled here
when a C compiler exists): real ctypes signatures, real CFUNCTYPE callbacks called from
C, CUPTI's result codes, record walking by cuptiActivityGetNextRecord.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from distanom.errors import TracerUnavailableError
from distanom.tracers.cupti import buffers, callbacks, library
from distanom.tracers.cupti.buffers import BufferPool
from distanom.tracers.cupti.library import CuptiError, CuptiLib, libcupti_candidates
from distanom.tracers.cupti.names import NameTable
from distanom.tracers.cupti.records import DecodeStats, buffer_view, decode_records
from distanom.tracers.cupti.session import ActivitySession
from tests.conftest import Ticks

HERE = Path(__file__).resolve().parent
T0 = 1_800_000_000_000_000_000


# -- BufferPool ------------------------------------------------------------------------


def test_pool_hands_out_aligned_distinct_buffers_up_to_its_budget() -> None:
    pool = BufferPool(4096, 3, clock=Ticks())
    got = [pool.request() for _ in range(3)]
    assert all(g is not None for g in got)
    addrs = [g[0] for g in got if g is not None]
    assert len(set(addrs)) == 3 and all(a % 8 == 0 for a in addrs)
    assert all(g is not None and g[1] == 4096 for g in got)
    assert pool.request() is None  # all three held by CUPTI: nothing to recycle
    assert pool.stats()["buffer_requests_refused"] == 1
    assert pool.stats()["buffers_held_by_cupti"] == 3


def test_pool_recycles_the_oldest_unpinned_completed_buffer() -> None:
    clock = Ticks()
    pool = BufferPool(4096, 3, clock=clock)
    a, b, c = (pool.request() for _ in range(3))
    assert a and b and c
    pool.complete(a[0], 100)
    t_a = clock.now
    pool.complete(b[0], 200)
    t_b = clock.now
    assert [x.valid_size for x in pool.completed()] == [100, 200]
    seq_a = pool.completed()[0].seq
    assert pool.pin(seq_a)
    again = pool.request()  # a is pinned: b goes
    assert again is not None and again[0] == b[0]
    assert pool.lost_through_ns == t_b
    assert [x.seq for x in pool.completed()] == [seq_a]
    pool.unpin(seq_a)
    assert pool.request() == (a[0], 4096)
    assert pool.lost_through_ns == max(t_a, t_b)
    assert pool.stats()["buffers_evicted"] == 2
    assert not pool.pin(seq_a)  # recycled: cannot be pinned any more


def test_pool_takes_back_empty_buffers_and_ignores_unknown_ones() -> None:
    pool = BufferPool(4096, 2, clock=Ticks())
    a = pool.request()
    assert a is not None
    pool.complete(a[0], 0)
    assert pool.completed() == []
    assert pool.request() == a  # back on the free list
    pool.complete(12345, 10)
    pool.complete(None, 10)
    assert pool.stats()["unknown_buffers_completed"] == 2
    assert pool.stats()["buffers_empty"] == 1


def test_pool_sizes_for_ring_budget() -> None:
    small = BufferPool.for_ring(8)
    assert (small.buffer_bytes, small.max_buffers) == (1 << 20, 8)
    big = BufferPool.for_ring(256)
    assert (big.buffer_bytes, big.max_buffers) == (1 << 20, 256)
    eights = BufferPool.for_ring(8, buffer_bytes=8 << 20)
    assert (eights.buffer_bytes, eights.max_buffers) == (2 << 20, 4)  # at least 4 buffers
    with pytest.raises(ValueError):
        BufferPool(4096, 1)


def test_release_keeps_buffers_cupti_still_holds_alive() -> None:
    pool = BufferPool(4096, 3, clock=Ticks())
    a, b = pool.request(), pool.request()
    assert a and b
    pool.complete(a[0], 64)
    before = len(buffers._UNRETURNED_BUFFERS)
    assert pool.release() == 1
    assert len(buffers._UNRETURNED_BUFFERS) == before + 1
    assert pool.completed() == []


def test_callbacks_dispatch_to_the_active_pool() -> None:
    pool = BufferPool(4096, 2, clock=Ticks())
    buf, size, nrec = ctypes.c_void_p(), ctypes.c_size_t(), ctypes.c_size_t(7)
    callbacks.active_pool = pool
    try:
        callbacks.REQUEST_CB(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(nrec))
        assert buf.value and size.value == 4096 and nrec.value == 0
        callbacks.COMPLETE_CB(None, 0, buf.value, 4096, 216)
        assert [b.valid_size for b in pool.completed()] == [216]
    finally:
        callbacks.active_pool = None
    callbacks.REQUEST_CB(ctypes.byref(buf), ctypes.byref(size), ctypes.byref(nrec))
    assert not buf.value and size.value == 0  # no session: CUPTI gets no buffer


# -- library discovery -----------------------------------------------------------------


def test_candidates_and_load_failures_are_explained() -> None:
    assert isinstance(libcupti_candidates(), list)
    with pytest.raises(TracerUnavailableError, match="libcupti not found"):
        CuptiLib.load([])
    with pytest.raises(TracerUnavailableError, match="cannot load libcupti from /nonexistent"):
        CuptiLib.load(["/nonexistent/libcupti.so.13"])


def test_env_override_is_a_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTANOM_LIBCUPTI", "/opt/x/libcupti.so.99")
    assert "/opt/x/libcupti.so.99" in libcupti_candidates()


# -- the binding against a fake libcupti ------------------------------------------------


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CuptiLib]:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the fake libcupti")
    out = tmp_path_factory.mktemp("fakecupti") / "libfakecupti_test.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(HERE / "fake_libcupti.c")],
        check=True,
        capture_output=True,
    )
    lib = CuptiLib.load([str(out)])
    dll: Any = lib._dll
    dll.fake_emit_kernel.argtypes = [
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_char_p,
        ctypes.c_int32,
    ]
    dll.fake_emit_kernel.restype = ctypes.c_int
    yield lib


@pytest.fixture
def session(fake_lib: CuptiLib) -> Iterator[ActivitySession]:
    dll: Any = fake_lib._dll
    dll.fake_set_busy(0)
    dll.fake_fail_enable(-1)
    dll.fake_fail_finalize(0)
    s = ActivitySession(fake_lib, BufferPool(4096, 4, clock=Ticks()))
    try:
        yield s
    finally:
        s.close()
    assert callbacks.active_pool is None


def test_plain_calls_and_error_strings(fake_lib: CuptiLib) -> None:
    assert fake_lib.version() == 130001
    assert fake_lib.timestamp() == T0
    assert fake_lib.result_string(39) == "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED"
    assert "no description" in fake_lib.result_string(12345)
    with pytest.raises(
        CuptiError,
        match=r"cuptiActivityEnable\(99\) failed: CUPTI error 21 \(CUPTI_ERROR_INVALID_KIND\)",
    ):
        fake_lib.enable(99)


def test_session_collects_records_through_the_callbacks(session: ActivitySession) -> None:
    dll: Any = session.lib._dll
    session.open()
    assert all(dll.fake_enabled(k) for k in library.TRACED_KINDS)
    assert dll.fake_subscribed() == 0  # the subscriber check unsubscribed again
    names = [f"kernel_{i}".encode() for i in range(30)]
    corrs = [dll.fake_emit_kernel(T0 + i * 100, T0 + i * 100 + 50, names[i], 1) for i in range(30)]
    assert all(c > 0 for c in corrs)
    assert len(session.pool.completed()) == 1  # 18 records fill a 4 KB buffer
    session.flush()
    done = session.pool.completed()
    assert [b.valid_size for b in done] == [18 * 216, 12 * 216]
    table = NameTable()
    seen: list[Any] = []
    for b in done:
        offsets = session.lib.record_offsets(b.address, b.valid_size)
        assert offsets == [i * 216 for i in range(b.valid_size // 216)]
        seen += decode_records(buffer_view(b.address, b.valid_size), offsets, table, DecodeStats())
    assert [r.correlation for r in seen] == corrs
    assert [r.name for r in seen] == [n.decode() for n in names]
    assert session.poll_dropped() == 0


def test_disabled_kinds_record_nothing_and_toggle_back(session: ActivitySession) -> None:
    dll: Any = session.lib._dll
    session.open()
    session.disable()
    assert dll.fake_emit_kernel(T0, T0 + 1, b"k", 1) == -1
    session.enable()
    assert dll.fake_emit_kernel(T0, T0 + 1, b"k", 1) > 0


def test_another_subscriber_makes_the_backend_unavailable(session: ActivitySession) -> None:
    dll: Any = session.lib._dll
    dll.fake_set_busy(1)
    with pytest.raises(TracerUnavailableError, match="already has a subscriber"):
        session.open()
    assert callbacks.active_pool is None


def test_enable_failure_rolls_back_and_names_the_kind(session: ActivitySession) -> None:
    dll: Any = session.lib._dll
    dll.fake_fail_enable(library.KIND_MEMSET)
    with pytest.raises(CuptiError, match=r"cuptiActivityEnable\(MEMSET\)"):
        session.open()
    assert not any(dll.fake_enabled(k) for k in library.TRACED_KINDS)
    assert callbacks.active_pool is None


def test_only_one_session_per_process_and_close_is_idempotent(session: ActivitySession) -> None:
    session.open()
    other = ActivitySession(session.lib, BufferPool(4096, 2))
    with pytest.raises(TracerUnavailableError, match="another distanom CUPTI session"):
        other.open()
    session.close()
    session.close()
    assert callbacks.active_pool is None


def test_detach_hands_every_buffer_back_and_attach_starts_a_new_epoch(
    session: ActivitySession,
) -> None:
    dll: Any = session.lib._dll
    session.open()
    assert session.lib.can_detach
    first = [dll.fake_emit_kernel(T0 + i, T0 + i + 1, b"before", 1) for i in range(3)]
    finalized = dll.fake_finalized()
    session.detach()
    assert dll.fake_finalized() == finalized + 1 and not session.attached
    assert not any(dll.fake_enabled(k) for k in library.TRACED_KINDS)
    done = session.pool.completed()
    assert [(b.valid_size, b.epoch) for b in done] == [(3 * 216, 0)]  # flushed before detaching
    assert session.pool.epoch == 1 and session.detaches == 1
    # Detached, a flush must not call CUPTI (the fake would fail: no callbacks registered).
    session.flush(forced=True)
    session.detach()  # idempotent
    assert dll.fake_emit_kernel(T0, T0 + 1, b"off", 1) == -1
    session.attach()
    assert session.attached and all(dll.fake_enabled(k) for k in library.TRACED_KINDS)
    assert dll.fake_subscribed() == 0  # the subscriber check ran and unsubscribed
    again = [dll.fake_emit_kernel(T0 + 9, T0 + 10, b"after", 1) for _ in range(2)]
    assert again[0] <= first[-1]  # the fake restarts correlation ids, as CUPTI may
    session.flush()
    newest = session.pool.completed()[-1]
    assert (newest.valid_size, newest.epoch) == (2 * 216, 1)


def test_attach_refuses_when_another_client_took_cupti_meanwhile(
    session: ActivitySession,
) -> None:
    dll: Any = session.lib._dll
    session.open()
    session.detach()
    dll.fake_set_busy(1)
    with pytest.raises(TracerUnavailableError, match="already has a subscriber"):
        session.attach()
    assert not session.attached
    dll.fake_set_busy(0)


def test_failed_detach_leaves_the_session_attached_and_disabled(
    session: ActivitySession,
) -> None:
    dll: Any = session.lib._dll
    session.open()
    dll.fake_fail_finalize(1)
    with pytest.raises(library.DetachError, match="cuptiFinalize"):
        session.detach()
    assert session.attached and not session.enabled and session.pool.epoch == 0
    session.flush()  # still attached: flushes go to CUPTI
    assert session.flushes >= 2


def test_pool_begin_epoch_abandons_buffers_cupti_still_holds() -> None:
    pool = BufferPool(4096, 4, clock=Ticks())
    held = pool.request()
    assert held is not None
    assert pool.begin_epoch() == 1
    assert pool.stats()["buffers_abandoned"] == 1
    pool.complete(held[0], 100)  # a late hand-back of an abandoned buffer is ignored
    assert pool.completed() == [] and pool.counters["unknown_buffers_completed"] == 1


def test_cupti_walks_buffers_only_while_attached(session: ActivitySession) -> None:
    dll: Any = session.lib._dll
    session.open()
    for i in range(3):
        dll.fake_emit_kernel(T0 + i, T0 + i + 1, b"k", 1)
    session.flush()
    buf = session.pool.completed()[-1]
    assert session.record_offsets(buf.address, buf.valid_size) == [0, 216, 432]
    session.detach()
    with pytest.raises(CuptiError, match="detached"):
        session.record_offsets(buf.address, buf.valid_size)
