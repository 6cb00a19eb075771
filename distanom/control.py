"""The file protocol between a running job and `distanom capture` / `distanom status`,
under its older import path.

Nothing listens on a port: a request is a small JSON file under `requests/` in the (shared)
run directory, rank 0 of the job polls that folder, carries the request to every rank
through the consensus round and answers with `<id>.response.json`; rank 0 also rewrites
`status.json` every few seconds. Each file's record, writer and reader live in
`distanom.records` (`requests`, `status`); this module re-exports them so existing
imports keep working. New code imports from `distanom.records`.
"""

from __future__ import annotations

from distanom.records.requests import (
    MAX_RANK_RANGES,
    MAX_REQUEST_BYTES,
    MAX_REQUEST_STEPS,
    Accepted,
    Refused,
    Request,
    answer,
    parse_ranks,
    pending_requests,
    read_response,
    response_path,
    submit_request,
    validate_request,
)
from distanom.records.status import STALE_AFTER_S, job_alive, read_status, write_status

__all__ = [
    "MAX_RANK_RANGES",
    "MAX_REQUEST_BYTES",
    "MAX_REQUEST_STEPS",
    "STALE_AFTER_S",
    "Accepted",
    "Refused",
    "Request",
    "answer",
    "job_alive",
    "parse_ranks",
    "pending_requests",
    "read_response",
    "read_status",
    "response_path",
    "submit_request",
    "validate_request",
    "write_status",
]
