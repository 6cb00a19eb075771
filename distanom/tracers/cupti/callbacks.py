"""The process-wide CUPTI buffer callbacks and the pool they serve.

Owns the three C function pointers distanom hands CUPTI: buffer request, buffer
completion, and the no-op subscriber callback used to detect another CUPTI client.
CUPTI takes one callback registration per process and keeps raw function pointers, so
these objects are module globals that live as long as the process and dispatch to
`active_pool`, the `BufferPool` of the one open `ActivitySession` (which sets it).

The callbacks run on CUPTI's threads and inside kernel launches: they only hand a
buffer out of the pool or append a completed one to it (no decoding, no large
allocation), and never let an exception propagate into CUPTI (`callback_errors` counts
them). Nothing here imports torch.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distanom.tracers.cupti.buffers import BufferPool

RequestFunc = ctypes.CFUNCTYPE(
    None,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_size_t),
    ctypes.POINTER(ctypes.c_size_t),
)
"""CUpti_BuffersCallbackRequestFunc."""
CompleteFunc = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
)
"""CUpti_BuffersCallbackCompleteFunc."""
SubscriberFunc = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
)
"""CUpti_CallbackFunc."""

# The pool the callbacks serve; None while no session is open (requests are refused).
active_pool: BufferPool | None = None
callback_errors = 0  # exceptions caught inside callbacks (never propagate into CUPTI)


def _on_buffer_request(
    buffer: ctypes._Pointer[ctypes.c_void_p],
    size: ctypes._Pointer[ctypes.c_size_t],
    max_records: ctypes._Pointer[ctypes.c_size_t],
) -> None:
    global callback_errors
    try:
        pool = active_pool
        got = pool.request() if pool is not None else None
        if got is None:
            buffer[0] = None
            size[0] = 0
        else:
            buffer[0] = got[0]
            size[0] = got[1]
        max_records[0] = 0  # fill the buffer
    except BaseException:
        callback_errors += 1
        try:
            buffer[0] = None
            size[0] = 0
        except BaseException:
            pass


def _on_buffer_complete(
    context: int | None, stream_id: int, buffer: int | None, size: int, valid_size: int
) -> None:
    global callback_errors
    try:
        pool = active_pool
        if pool is not None:
            pool.complete(buffer, valid_size)
    except BaseException:
        callback_errors += 1


def _on_subscriber_callback(userdata: int | None, domain: int, cbid: int, data: int | None) -> None:
    return None  # never enabled for any domain: only used to probe for another subscriber


REQUEST_CB = RequestFunc(_on_buffer_request)
COMPLETE_CB = CompleteFunc(_on_buffer_complete)
SUBSCRIBER_CB = SubscriberFunc(_on_subscriber_callback)
