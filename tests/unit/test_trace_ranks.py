"""Trace files name their rank the way HolisticTraceAnalysis reads it: `distributedInfo`
first in the file, `"rank": N` with a space (HTA takes the first match of that pattern)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest

from distanom.capture import encode_document


def document(rank: int) -> dict:
    return {
        "schemaVersion": 1,
        "deviceProperties": [],
        "distributedInfo": {"rank": rank, "world_size": 4, "backend": "nccl"},
        "baseTimeNanoseconds": 1_700_000_000_000_000_000,
        "distanom": {"step": 7, "rank": rank},
        "traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
             "ts": 10.0, "dur": 5.0, "args": {"rank": 99}},
        ],
    }  # fmt: skip


def test_the_rank_comes_first_with_a_space() -> None:
    encoded = encode_document(document(3))
    assert encoded.startswith(b'{"distributedInfo": {"rank": 3, "world_size": 4, ')
    assert json.loads(encoded) == document(3)


def test_a_distributed_info_that_is_not_plain_json_still_encodes() -> None:
    odd = document(1)
    odd["distributedInfo"]["bad"] = float("nan")
    assert json.loads(encode_document(odd))["distributedInfo"]["bad"] is None


@pytest.mark.skipif(
    importlib.util.find_spec("hta") is None,
    reason="HolisticTraceAnalysis is not installed (pip install -e '.[interop]')",
)
def test_hta_reads_a_folder_of_ranks_rank_by_rank(tmp_path: Path) -> None:
    from hta.common.trace_file import get_trace_files

    for rank in range(4):
        (tmp_path / f"rank{rank}.trace.json.gz").write_bytes(
            gzip.compress(encode_document(document(rank)))
        )
    found = get_trace_files(str(tmp_path))
    assert sorted(found) == [0, 1, 2, 3]
    assert all(Path(path).name == f"rank{rank}.trace.json.gz" for rank, path in found.items())
