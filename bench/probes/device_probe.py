"""One-off device probe: facts the CUPTI backend and the kineto cutter are built on.

Run on the accelerator machine with cupti-python carried as a wheel; prints record
layouts (from cupti-python's numpy dtypes), raw CUPTI records of a few known operations
collected through ctypes buffer callbacks, the kernel names of step markers candidates,
and saves a small CUDA-only Kineto trace of 3 steps for tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import gzip
import json
import os
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

OUT = os.environ.get("OUT", "/tmp")
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))

try:
    import cupti.cupti as cc  # type: ignore

    for name in [
        "activity_kernel10_dtype",
        "activity_memcpy6_dtype",
        "activity_memset4_dtype",
        "activity_cuda_event2_dtype",
        "activity_synchronization2_dtype",
        "activity_marker2_dtype",
        "activity_external_correlation_dtype",
        "activity_api_dtype",
    ]:
        dt = getattr(cc, name)
        fields = sorted(((off[1], fname, str(off[0])) for fname, off in dt.fields.items()))
        print(
            f"DTYPE {name} itemsize={dt.itemsize}: "
            + ", ".join(f"{o}:{n}:{t}" for o, n, t in fields)
        )
    print("KINDS", {k.name: int(k) for k in cc.ActivityKind})
except Exception as err:
    print("cupti-python unavailable:", repr(err))
    cc = None

libs = sorted(
    glob.glob(
        os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "**", "libcupti.so*"),
        recursive=True,
    )
)
print("libcupti candidates", libs)
lib = ctypes.CDLL(libs[0])
uint = ctypes.c_uint32
BUF_REQ = ctypes.CFUNCTYPE(
    None,
    ctypes.POINTER(ctypes.c_void_p),
    ctypes.POINTER(ctypes.c_size_t),
    ctypes.POINTER(ctypes.c_size_t),
)
BUF_DONE = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, uint, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t
)
BUFSIZE = 8 << 20
keep = {}
done = []


def req(buf, size, maxrec):
    b = ctypes.create_string_buffer(BUFSIZE + 8)
    addr = ctypes.addressof(b)
    aligned = (addr + 7) & ~7
    keep[aligned] = b
    buf[0] = aligned
    size[0] = BUFSIZE
    maxrec[0] = 0


def comp(ctx, stream, buf, size, valid):
    done.append((buf, valid))


req_cb, done_cb = BUF_REQ(req), BUF_DONE(comp)
print("register", lib.cuptiActivityRegisterCallbacks(req_cb, done_cb))
KINDS = {"MEMCPY": 1, "MEMSET": 2, "CONCURRENT_KERNEL": 10}
if cc is not None:
    KINDS = {k: int(getattr(cc.ActivityKind, k)) for k in ["MEMCPY", "MEMSET", "CONCURRENT_KERNEL"]}
    with contextlib.suppress(AttributeError):
        KINDS["CUDA_EVENT"] = int(cc.ActivityKind.CUDA_EVENT)
for k, v in KINDS.items():
    print("enable", k, v, lib.cuptiActivityEnable(uint(v)))
ts = ctypes.c_uint64()
lib.cuptiGetTimestamp(ctypes.byref(ts))
print("cupti ts", ts.value, "time_ns", time.time_ns())

# known operations
torch.cuda.set_device(0)
x = torch.randn(1024, 1024, device="cuda")
marker = torch.zeros(1, device="cuda", dtype=torch.int32)
fn = None
try:
    fn = torch.cuda.jiterator._create_jit_fn(
        "template <typename T> T distanom_step_marker(T x) { return x + T(1); }"
    )
except Exception as err:
    print("jiterator failed", repr(err))
host_marks = []
for _i in range(3):
    y = x @ x
    torch.cuda._sleep(1000)
    host_marks.append(time.time_ns())
    if fn is not None:
        marker = fn(marker)
    z = torch.empty(4096, device="cuda").zero_()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    h = torch.ones(256).cuda()
    h2 = h.cpu()
torch.cuda.synchronize()
print("flush", lib.cuptiActivityFlushAll(uint(1)))
dropped = ctypes.c_size_t()
lib.cuptiActivityGetNumDroppedRecords(None, uint(0), ctypes.byref(dropped))
print("dropped", dropped.value)

lib.cuptiActivityGetNextRecord.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_void_p),
]
dts = {}
if cc is not None:
    dts = {
        KINDS["CONCURRENT_KERNEL"]: cc.activity_kernel10_dtype,
        KINDS["MEMCPY"]: cc.activity_memcpy6_dtype,
        KINDS["MEMSET"]: cc.activity_memset4_dtype,
    }
    if "CUDA_EVENT" in KINDS:
        dts[KINDS["CUDA_EVENT"]] = cc.activity_cuda_event2_dtype
n = 0
prev = None
for buf, valid in done:
    rec = ctypes.c_void_p(0)
    while (
        lib.cuptiActivityGetNextRecord(
            ctypes.c_void_p(buf), ctypes.c_size_t(valid), ctypes.byref(rec)
        )
        == 0
    ):
        addr = rec.value
        kind = ctypes.c_uint32.from_address(addr).value
        raw = ctypes.string_at(addr, 160)
        step = (addr - prev) if prev else 0
        prev = addr
        line = f"REC kind={kind} stride_from_prev={step} hex={raw[:120].hex()}"
        dt = dts.get(kind)
        if dt is not None:
            arr = np.frombuffer(ctypes.string_at(addr, dt.itemsize), dtype=dt)[0]
            vals = {}
            for fname in dt.names:
                v = arr[fname]
                if fname == "name" and int(v) != 0:
                    v = ctypes.string_at(int(v)).decode(errors="replace")[:100]
                elif isinstance(v, (np.ndarray, np.void)):
                    v = "arr"
                vals[fname] = (
                    v
                    if isinstance(v, str)
                    else (int(v) if np.issubdtype(type(v), np.integer) else str(v))
                )
            line += " " + json.dumps(vals, default=str)
        print(line)
        n += 1
print("records", n, "host marks", host_marks)

lib.cuptiActivityFlushAll(uint(1))
for v in KINDS.values():
    lib.cuptiActivityDisable(uint(v))

# Kineto CUDA-only trace of 3 steps of a tiny model

model = torch.nn.Sequential(
    torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
inp = torch.randn(32, 256, device="cuda")
marks = []
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _i in range(3):
        loss = model(inp).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if fn is not None:
            marker = fn(marker)
        marks.append(time.time_ns())
torch.cuda.synchronize()
path = os.path.join(OUT, "kineto_cuda_3steps.json")
prof.export_chrome_trace(path)
with open(path) as f:
    doc = json.load(f)
os.remove(path)
with gzip.open(path + ".gz", "wt") as f:
    json.dump(doc, f)
cats = {}
for e in doc["traceEvents"]:
    cats[e.get("cat")] = cats.get(e.get("cat"), 0) + 1
print(
    "KINETO cats",
    cats,
    "keys",
    [k for k in doc if k != "traceEvents"],
    "base",
    doc.get("baseTimeNanoseconds"),
    "marks",
    marks,
)
for cat in ["kernel", "cuda_runtime", "ac2g", "gpu_memcpy", "gpu_memset", "cuda_driver"]:
    ex = [e for e in doc["traceEvents"] if e.get("cat") == cat][:2]
    print("KINETO", cat, json.dumps(ex))
print(
    "KINETO marker kernels",
    [
        e["name"]
        for e in doc["traceEvents"]
        if e.get("cat") == "kernel" and "marker" in e.get("name", "")
    ][:3],
)
