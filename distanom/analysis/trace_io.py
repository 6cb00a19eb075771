"""Strict, bounded loading of Kineto chrome traces (`.json` / `.json.gz`) into a compact `Trace`.

Owns: reading a trace file from disk (gzip or plain JSON, decided by the gzip magic
bytes, never by the suffix alone) with a cap on the decompressed size, validating its
shape, and reducing it to the few fields the analysis tables need. Reads: one file.
Hands on: `read_trace_document` gives the raw top-level object to tools that need every
event (e.g. a merged all-rank trace); `load_trace` / `trace_from_document` give a frozen
`Trace` to `distanom.analysis.tables`, which holds only

* the GPU events (`cat` kernel / gpu_memcpy / gpu_memset) as `GpuEvent` tuples, each
  carrying its launch link category (`"runtime"`, `"graph"` or None when unlinked);
* the host spans (`cat` cpu_op / user_annotation, `ph` X) as `HostEvent` tuples, for the
  CPU-only breakdown;
* the metadata `distributedInfo`, `baseTimeNanoseconds` and `deviceProperties`.

Everything else in the file (python_function events, flows, runtime calls) is dropped
once the links are resolved, so a `Trace` costs memory in proportion to its GPU events.
Every problem with the file raises `TraceFormatError` with a one-line message naming the
file. Nothing is ever unpickled or evaluated.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import os
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from distanom.errors import TraceFormatError

_orjson: Any
try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - orjson is a declared dependency
    _orjson = None

__all__ = [
    "DEFAULT_MAX_BYTES",
    "GPU_CATEGORIES",
    "HOST_CATEGORIES",
    "GpuEvent",
    "HostEvent",
    "Trace",
    "load_trace",
    "read_trace_document",
    "trace_from_document",
]

DEFAULT_MAX_BYTES = 2 * 1024**3
"""Largest decompressed JSON text `read_trace_document` accepts (2 GiB)."""

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""`cat` values of the GPU events that make up the GPU timeline."""

HOST_CATEGORIES = ("cpu_op", "user_annotation")
"""`cat` values of the host spans (`ph` X) kept for the CPU-only breakdown."""

_GPU_SET = frozenset(GPU_CATEGORIES)
_HOST_SET = frozenset(HOST_CATEGORIES)
_RUNTIME_CATEGORIES = frozenset(("cuda_runtime", "cuda_driver"))
_GRAPH_LAUNCHERS = frozenset(("cudaGraphLaunch", "hipGraphLaunch"))
_GZIP_MAGIC = b"\x1f\x8b"
_READ_CHUNK = 1 << 20
_GC_LOCK = threading.Lock()
_gc_pauses = 0
_gc_was_enabled = False


class GpuEvent(NamedTuple):
    """One GPU event, times in the trace's microseconds (floats as stored)."""

    cat: str
    """`kernel`, `gpu_memcpy` or `gpu_memset`."""
    name: str
    ts: float
    dur: float
    stream: int | None
    """`args.stream`; None when the event has none."""
    device: int | None
    """`args.device`, else the event's integer `pid`, else None."""
    correlation: int | None
    """`args.correlation` (None when absent)."""
    external_id: int | None
    """`args["External id"]` (None when absent)."""
    link: str | None
    """Category of the runtime/driver call that launched it: "graph" (a CUDA/HIP graph
    launch), "runtime" (any other launch), None when no launch is linked to it."""


class HostEvent(NamedTuple):
    """One host span (`cat` cpu_op or user_annotation, `ph` X), times in µs."""

    cat: str
    name: str
    ts: float
    dur: float
    pid: int | str
    tid: int | str


@dataclass(frozen=True)
class Trace:
    """The parts of one trace file that the analysis needs, in compact form."""

    source: str
    """Where it came from (the file path, or the name given to `trace_from_document`)."""
    gpu_events: tuple[GpuEvent, ...]
    """GPU events in file order."""
    host_events: tuple[HostEvent, ...]
    """cpu_op and user_annotation spans in file order."""
    distributed_info: Mapping[str, Any] | None
    """Top-level `distributedInfo` (rank, world_size, backend...), None when absent."""
    base_time_ns: int | None
    """Top-level `baseTimeNanoseconds`: `ts` µs + this = Unix-epoch time; None when absent."""
    device_properties: tuple[Mapping[str, Any], ...]
    """Top-level `deviceProperties`, empty when absent."""


def _fail(source: str | os.PathLike[str], problem: str) -> TraceFormatError:
    return TraceFormatError(f"{os.fspath(source)}: {problem}")


def _read_capped(path: Path, max_bytes: int) -> tuple[bytes, bool]:
    """The file's JSON text (gunzipped when it starts with the gzip magic, at most
    max_bytes) and whether it was gzip."""
    try:
        with path.open("rb") as raw:
            magic = raw.read(2)
            raw.seek(0)
            if magic == _GZIP_MAGIC:
                return _gunzip_capped(path, raw, max_bytes), True
            if os.fstat(raw.fileno()).st_size > max_bytes:
                raise _fail(path, f"larger than the limit of {max_bytes} bytes")
            data = raw.read(max_bytes + 1)  # bounded again: the file may be growing
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except IsADirectoryError:
        raise _fail(path, "is a directory, not a trace file") from None
    except OSError as err:
        raise _fail(path, f"cannot be read ({err.strerror or err})") from None
    if len(data) > max_bytes:
        raise _fail(path, f"larger than the limit of {max_bytes} bytes")
    return data, False


def _gunzip_capped(path: Path, raw: Any, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    try:
        with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            while True:
                chunk = gz.read(min(_READ_CHUNK, max_bytes + 1 - total))
                if not chunk:
                    break
                total += len(chunk)
                if total > max_bytes:
                    raise _fail(
                        path,
                        f"decompresses to more than the limit of {max_bytes} bytes "
                        "(damaged or not a trace?)",
                    )
                chunks.append(chunk)
    except EOFError:
        raise _fail(path, "truncated gzip (the compressed stream ends early)") from None
    except (gzip.BadGzipFile, zlib.error) as err:
        raise _fail(path, f"damaged gzip data ({err})") from None
    return b"".join(chunks)


PARSE_MEMORY_FACTOR = 30
"""Memory a parsed trace takes per byte of JSON text (Python objects per event, measured
~29x on Kineto traces)."""


def available_memory() -> int:
    """Bytes of memory available to parse into (Linux MemAvailable; 2**62 when unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2**62


def _reject_constant(token: str) -> Any:
    raise ValueError(f"non-standard JSON constant {token}")


def _parse_json(text: bytes) -> Any:
    """orjson (a dependency: ~4x faster on traces), else the standard library. What
    orjson refuses is parsed again by the standard library, whose message says what is
    wrong (e.g. a NaN constant) and which also reads valid JSON orjson cannot (integers
    beyond 64 bits)."""
    if _orjson is not None:
        try:
            return _orjson.loads(text)
        except _orjson.JSONDecodeError:
            pass
    doc = json.loads(text, parse_constant=_reject_constant)
    _refuse_huge_times(doc)  # only this parser reads integers beyond 64 bits
    return doc


def _refuse_huge_times(doc: Any) -> None:
    """ValueError when an event's ts or dur is an integer beyond 64 bits: no float holds
    it, so every later sum with it would overflow."""
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    for event in events if isinstance(events, list) else ():
        if not isinstance(event, dict):
            continue
        for key in ("ts", "dur"):
            value = event.get(key)
            if type(value) is int and not -(2**63) <= value < 2**63:
                raise ValueError(f"an event's {key} is an integer beyond 64 bits")


def read_trace_document(
    path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES
) -> dict[str, Any]:
    """Parse a trace file and return its top-level object (with every event).

    Gzip is detected by its magic bytes, so a gzipped file named `.json` works too.
    Raises `TraceFormatError` when the file is missing, truncated or damaged gzip, larger
    than `max_bytes` once decompressed or than this machine's memory can parse, not JSON
    (NaN/Infinity included), not an object, or has no `traceEvents` list. A
    `baseTimeNanoseconds` outside 0..2**63 is dropped.
    """
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    p = Path(path)
    # parsing needs ~PARSE_MEMORY_FACTOR times the text: refuse before reading (or
    # decompressing) a text this machine cannot parse
    room = available_memory() // PARSE_MEMORY_FACTOR
    if room < max_bytes:
        try:
            text, is_gzip = _read_capped(p, room)
        except TraceFormatError as err:
            if "larger than" in str(err) or "decompresses to more" in str(err):
                raise _fail(
                    p,
                    f"too large to parse here: more than {room} bytes of JSON need more than "
                    f"~{room * PARSE_MEMORY_FACTOR / 1e9:.1f} GB, the memory available",
                ) from None
            raise
    else:
        text, is_gzip = _read_capped(p, max_bytes)
    try:
        with _gc_paused():
            doc = _parse_json(text)
    except RecursionError:
        raise _fail(p, "not a trace: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as err:
        problem = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not text.strip():
            problem = "no content"
        what = "gzip content is not valid JSON" if is_gzip else "not gzip and not valid JSON"
        raise _fail(p, f"{what} ({problem})") from None
    del text
    if not isinstance(doc, dict):
        raise _fail(p, f"top level is a JSON {_json_type(doc)}, not an object")
    if not isinstance(doc.get("traceEvents"), list):
        raise _fail(p, "no 'traceEvents' list at the top level")
    if "baseTimeNanoseconds" in doc and _base_time(doc["baseTimeNanoseconds"]) is None:
        del doc["baseTimeNanoseconds"]  # implausible (e.g. 400 digits): as if absent
    return doc


def load_trace(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> Trace:
    """Read a trace file and reduce it to a compact `Trace` (see `trace_from_document`)."""
    with _gc_paused():
        doc = read_trace_document(path, max_bytes=max_bytes)
        _refuse_merged(doc, path)
        trace = trace_from_document(doc, os.fspath(path))
        del doc  # freed by reference counting before the cyclic GC resumes
    return trace


def _refuse_merged(doc: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """The report's merged trace holds every rank (for viewing): one table of it would
    add the ranks' times together, so it is refused by name."""
    own = doc.get("distanom")
    if isinstance(own, dict) and own.get("merged") is True:
        ranks = own.get("ranks")
        count = f"{len(ranks)} ranks" if isinstance(ranks, dict) else "every rank"
        raise _fail(
            path,
            f"a merged trace of {count}, for viewing; analyze one rank's file "
            "(rank<R>.trace.json.gz beside it)",
        )


# Whether loads may pause the cyclic GC. Inside a training process the agent turns it off:
# the switch is process-wide and must not race with a script that manages the GC itself.
PAUSE_GC_DURING_LOAD = True


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (if it was on) for the duration.

    Parsing allocates one dict per event, which would trigger repeated full scans of a
    young generation that cannot contain garbage yet; pausing saves ~30-40% of the load
    time on large traces. Trace documents hold no reference cycles, so the objects are
    freed by reference counting once dropped. The switch is process-wide: other threads
    just see no cyclic collection for the fraction of a second a load takes.
    """
    global _gc_pauses, _gc_was_enabled
    if not PAUSE_GC_DURING_LOAD:
        yield
        return
    with _GC_LOCK:  # concurrent or nested loads: the last one out restores the GC
        if _gc_pauses == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_was_enabled:
                gc.enable()


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "null" if value is None else type(value).__name__


def _optional_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _base_time(value: Any) -> int | None:
    """`baseTimeNanoseconds` when a plausible Unix time in ns (0..2**63), else None."""
    base = _optional_int(value)
    return base if base is not None and 0 <= base < 2**63 else None


def _place(value: Any) -> int | str:
    """A pid/tid as int or str (anything else is stringified)."""
    if isinstance(value, (int, str)) and not isinstance(value, bool):
        return value
    return "" if value is None else str(value)


def is_finite_number(value: Any) -> TypeGuard[float]:
    """A finite JSON number (bool excluded) within ±MAX_TIME_US (an integer too large for
    a float, e.g. 400 digits, is not)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and -MAX_TIME_US <= value <= MAX_TIME_US
    )


MAX_TIME_US = 1e17
"""Largest |ts| or dur accepted (µs, ~3,000 years): Unix-epoch µs are ~1.8e15; a larger
value is damage, and sums of two such values stay finite."""


def trace_from_document(doc: Mapping[str, Any], source: str) -> Trace:
    """Reduce a parsed trace (top-level object) to a `Trace`; `source` names it in errors.

    GPU events must have numeric `ts` and a numeric, non-negative `dur`, else
    `TraceFormatError`. Host spans with a missing or non-numeric time are skipped (they
    only feed the CPU-only breakdown).
    """
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise _fail(source, "no 'traceEvents' list at the top level")
    gpu: list[dict[str, Any]] = []
    runtime: list[dict[str, Any]] = []
    flows: list[dict[str, Any]] = []
    host: list[dict[str, Any]] = []
    gpu_cats = _GPU_SET
    host_cats = _HOST_SET
    runtime_cats = _RUNTIME_CATEGORIES
    try:
        for e in events:
            cat = e.get("cat")
            if cat in gpu_cats:
                gpu.append(e)
            elif cat == "ac2g":
                flows.append(e)
            elif cat in runtime_cats:
                runtime.append(e)
            elif cat in host_cats and e.get("ph") == "X":
                host.append(e)
    except (AttributeError, TypeError):
        bad = next(i for i, e in enumerate(events) if not isinstance(e, dict))
        raise _fail(source, f"traceEvents[{bad}] is not an object") from None

    try:
        links = _LinkTables.build(runtime, flows)
        gpu_events = tuple([_gpu_event(source, e, links) for e in gpu])
    except TypeError:  # an id, correlation or pid that is a list/object: unhashable
        raise _fail(source, "an event id/correlation/pid is not a scalar") from None
    host_events = tuple(
        HostEvent(
            e["cat"],
            str(e.get("name", "")),
            e["ts"],
            e["dur"],
            _place(e.get("pid")),
            _place(e.get("tid")),
        )
        for e in host
        if is_finite_number(e.get("ts")) and is_finite_number(e.get("dur")) and e["dur"] >= 0
    )
    info = doc.get("distributedInfo")
    props = doc.get("deviceProperties")
    return Trace(
        source=source,
        gpu_events=gpu_events,
        host_events=host_events,
        distributed_info=info if isinstance(info, dict) else None,
        base_time_ns=_base_time(doc.get("baseTimeNanoseconds")),
        device_properties=tuple(p for p in props if isinstance(p, dict))
        if isinstance(props, list)
        else (),
    )


def _args(event: Mapping[str, Any]) -> Mapping[str, Any]:
    args = event.get("args")
    return args if isinstance(args, dict) else {}


_NUMBER_TYPES = (int, float)


def _gpu_event(source: str, e: Mapping[str, Any], links: _LinkTables) -> GpuEvent:
    ts: Any = e.get("ts")
    dur: Any = e.get("dur")
    if not (
        type(ts) in _NUMBER_TYPES
        and type(dur) in _NUMBER_TYPES
        and -MAX_TIME_US <= ts <= MAX_TIME_US
        and 0 <= dur <= MAX_TIME_US
    ):
        raise _fail(
            source,
            f"{e.get('cat')} event {str(e.get('name'))[:60]!r} has no valid ts/dur "
            f"(ts={_short(ts)}, dur={_short(dur)})",
        )
    args = e.get("args")
    if type(args) is not dict:
        args = {}
    name = e.get("name")
    device = args.get("device")
    if type(device) is not int:
        device = _optional_int(device)
        if device is None:
            device = _optional_int(e.get("pid"))
    stream = args.get("stream")
    correlation = args.get("correlation")
    external_id = args.get("External id")
    return GpuEvent(
        cat=e["cat"],
        name=name if type(name) is str else str(name),
        ts=ts,
        dur=dur,
        stream=stream if type(stream) is int else _optional_int(stream),
        device=device,
        correlation=correlation if type(correlation) is int else _optional_int(correlation),
        external_id=external_id if type(external_id) is int else _optional_int(external_id),
        link=links.category(e, correlation if links.key == "correlation" else external_id),
    )


def _short(value: Any) -> str:
    """repr of a value for an error line, at most 40 characters (never a 400-digit int:
    str() of one that large raises)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**30:
        return "<integer too large>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _link_key(runtime: Sequence[Mapping[str, Any]]) -> str:
    """`correlation` if the first launch call carries it, else `External id`."""
    for r in runtime:
        name = r.get("name")
        if isinstance(name, str) and "launch" in name.lower():
            return "correlation" if "correlation" in _args(r) else "External id"
    return "correlation"


@dataclass(frozen=True)
class _LinkTables:
    """Which GPU events a runtime/driver call is linked to (reference §4).

    A call with key value X is linked to the GPU events with the same X at the pid/tid
    of a flow-end event (`ac2g`, `ph` f, `id` X), when the flow start (`ph` s, `id` X)
    exists too; a call named exactly cudaGraphLaunch/hipGraphLaunch is linked to every
    GPU event with key X. Launcher names containing "cudagraph"/"graphlaunch" give the
    category "graph", any other "runtime". The key is `correlation` when the first
    launch call carries it, else `External id`.
    """

    key: str
    by_flow: dict[Any, str]
    """key value → category, for calls with a complete flow pair"""
    by_key: dict[Any, str]
    """key value → category, for graph launches (no flow needed)"""
    flow_ends: set[tuple[Any, Any, Any]]
    """(pid, tid, id) of every flow-end event"""

    @classmethod
    def build(
        cls, runtime: Sequence[Mapping[str, Any]], flows: Sequence[Mapping[str, Any]]
    ) -> _LinkTables:
        key = _link_key(runtime)
        by_flow: dict[Any, str] = {}
        by_key: dict[Any, str] = {}
        if not runtime:
            return cls(key, by_flow, by_key, set())
        starts = {f.get("id") for f in flows if f.get("ph") == "s"}
        ends = {(f.get("pid"), f.get("tid"), f.get("id")) for f in flows if f.get("ph") == "f"}
        end_ids = {x for _, _, x in ends}
        for r in runtime:
            x = _args(r).get(key)
            if x is None:
                continue
            name = r.get("name")
            name = name if isinstance(name, str) else ""
            lowered = name.lower()
            category = "graph" if "cudagraph" in lowered or "graphlaunch" in lowered else "runtime"
            if name in _GRAPH_LAUNCHERS:
                by_key[x] = category
            elif x in starts and x in end_ids:
                by_flow[x] = category
        return cls(key, by_flow, by_key, ends)

    def category(self, event: Mapping[str, Any], x: Any) -> str | None:
        """Category of the call linked to GPU event `event` whose key value is `x`."""
        if x is None:
            return None
        category = self.by_key.get(x)
        if (
            category is None
            and x in self.by_flow
            and (event.get("pid"), event.get("tid"), x) in self.flow_ends
        ):
            category = self.by_flow[x]
        return category
