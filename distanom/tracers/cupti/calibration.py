"""Start-up calibration of the cupti backend: learn the marker grids, check the layouts.

Owns `calibrate`, run once by `CuptiTracer.start` with CUPTI enabled: it launches every
marker shape once plus one 16-byte host-to-device copy, reads the records back through
CUPTI's own walker and checks the marker name, the record layouts (kernel, memcpy, and
the record sizes `iterate_by_size` walks by), the ordering and the clock against the
host. The resulting `Calibration` (grid -> code, clock offset, correlation floor) goes to
the tracer and its `StepResolver`; a failed check raises TracerUnavailableError.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from distanom.errors import TracerUnavailableError
from distanom.tracers.cupti.buffers import BufferPool
from distanom.tracers.cupti.library import KIND_MEMCPY, CuptiLib
from distanom.tracers.cupti.marker import (
    MARKER_LENGTH_STRIDE,
    JiteratorMarker,
    StepMarker,
    marker_length,
)
from distanom.tracers.cupti.matching import CLOCK_TOLERANCE_NS
from distanom.tracers.cupti.names import NameTable
from distanom.tracers.cupti.records import (
    BufferIndex,
    DecodeStats,
    MarkerRecord,
    buffer_view,
    decode_records,
    iterate_by_size,
)
from distanom.tracers.cupti.resolver import StepResolver
from distanom.tracers.cupti.session import ActivitySession

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Calibration:
    """What `start()` learned from launching each marker shape once."""

    grid_to_code: dict[int, int]
    lengths: list[int]  # jiterator marker: input length per code (else empty)
    grids: list[int]
    block_work_size: int | None  # jiterator: elements per block if grid == ceil(length / it)
    correlation_floor: int
    clock_offset_ns: int  # CUPTI timestamp - time.time_ns()
    memcpy_checked: bool
    cupti_version: int
    library: str
    marker: str = "driver"  # which StepMarker launched the markers
    size_walk_checked: bool = False  # record sizes agree with cuptiActivityGetNextRecord


def calibrate(
    torch: Any,
    lib: CuptiLib,
    session: ActivitySession,
    pool: BufferPool,
    names: NameTable,
    device: int,
    marker: StepMarker,
    codes: int,
) -> Calibration:
    """Launch every marker shape once (plus one 16-byte host-to-device copy), read
    the records back and check layout, names, ordering and clock."""
    offsets = []
    for _ in range(3):
        offsets.append(lib.timestamp() - time.time_ns())
    clock_offset = sorted(offsets)[1]
    before = time.time_ns()
    for code in range(codes):
        marker.launch(code)
    host = torch.arange(4, dtype=torch.int32)
    copied = host.to(f"cuda:{device}")
    torch.cuda.synchronize()
    after = time.time_ns()
    del copied
    resolver = StepResolver(
        pool, lib.record_offsets, names, grid_to_code={}, num_codes=codes, history_steps=2
    )
    markers: list[MarkerRecord] = []
    indexes: list[BufferIndex] = []
    # After a synchronize the records exist, but CUPTI may still be completing them:
    # retry the default flush (which returns only complete buffers) for up to ~2 s
    # before a forced one (which may return unfinished records with zero timestamps).
    for attempt in range(100):
        session.flush(forced=attempt == 99)
        indexes = resolver.index_since(0)
        markers = sorted((m for i in indexes for m in i.markers), key=lambda m: m.correlation)
        if len(markers) >= codes:
            break
        time.sleep(0.02)
    log.debug("calibration: %d flush(es) to get %d markers", attempt + 1, len(markers))
    problems: list[str] = []
    if len(markers) != codes:
        problems.append(f"expected {codes} marker records, CUPTI delivered {len(markers)}")
    grids = [m.grid_x for m in markers]
    if len(set(grids)) != len(grids):
        problems.append(f"marker grids not distinct: {grids}")
    lo, hi = (
        before + clock_offset - CLOCK_TOLERANCE_NS,
        after + clock_offset + CLOCK_TOLERANCE_NS,
    )
    for m in markers:
        if not (lo <= m.start_ns <= m.end_ns <= hi):
            problems.append(
                f"marker timestamps [{m.start_ns}, {m.end_ns}] outside the host "
                f"window [{lo}, {hi}] (clock or record layout wrong)"
            )
            break
    if problems:
        raise TracerUnavailableError("CUPTI marker calibration failed: " + "; ".join(problems))
    floor = max((idx.max_correlation for idx in indexes), default=0)
    memcpy_checked = check_memcpy(indexes, pool, names, markers[-1].correlation)
    size_walk_checked = check_size_walk(pool, lib)
    lengths: list[int] = []
    block_work: int | None = None
    if isinstance(marker, JiteratorMarker):
        # Report torch's launch formula as observed: grid = ceil(length / block work
        # size), the block work size a multiple of the 128-thread block.
        lengths = [marker_length(c) for c in range(codes)]
        for bw in range(128, 16 * MARKER_LENGTH_STRIDE + 1, 128):
            if all(math.ceil(n / bw) == g for n, g in zip(lengths, grids, strict=True)):
                block_work = bw
                break
    return Calibration(
        grid_to_code={g: c for c, g in enumerate(grids)},
        lengths=lengths,
        grids=grids,
        block_work_size=block_work,
        marker=marker.kind,
        size_walk_checked=size_walk_checked,
        correlation_floor=floor,
        clock_offset_ns=clock_offset,
        memcpy_checked=memcpy_checked,
        cupti_version=lib.version(),
        library=lib.path,
    )


def check_size_walk(pool: BufferPool, lib: CuptiLib) -> bool:
    """Whether walking by distanom's record sizes finds exactly the records CUPTI's
    own walker finds, in the calibration buffers (kernels and a memcpy)."""
    buffers = pool.completed()
    for buf in buffers:
        try:
            ours = iterate_by_size(buffer_view(buf.address, buf.valid_size))
        except ValueError:
            return False
        if ours != lib.record_offsets(buf.address, buf.valid_size):
            return False
    return bool(buffers)


def check_memcpy(
    indexes: list[BufferIndex], pool: BufferPool, names: NameTable, after_corr: int
) -> bool:
    """Whether the 16-byte host-to-device copy made during calibration decodes as one
    (after the marker of correlation `after_corr`); logs what was seen if not."""
    by_seq = {b.seq: b for b in pool.completed()}
    seen: list[str] = []  # other threads may copy meanwhile: not proof of a bad layout
    for idx in indexes:
        buf = by_seq.get(idx.seq)
        if buf is None:
            continue
        mask = (idx.kinds == KIND_MEMCPY) & (idx.correlation > after_corr)
        view = buffer_view(buf.address, buf.valid_size)
        stats = DecodeStats()
        for rec in decode_records(view, idx.offsets[mask].tolist(), names, stats):
            if rec.bytes == 16 and rec.copy_kind == 1:
                return True
            seen.append(f"{rec.bytes} bytes, copy kind {rec.copy_kind}")
    log.warning(
        "calibration: no record of the 16-byte host-to-device copy (memcpy records seen: "
        "%s); memcpy layout unchecked",
        seen or "none",
    )
    return False
