"""Timing and profiling helpers of the GPU benchmarks (``benchmarks/gpu.py``, ``benchmarks/gpu_decode.py``):
a synchronised timer, the top CUDA kernels of a call, and the GPU's idle gaps in a trace by the host frame
running when each began."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch


def sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def kernel_profile(fn, top: int = 15) -> list[str]:
    """The ``top`` CUDA kernels of one call of ``fn`` by total time, and the time by kind of kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    if not events:
        return [f"no CUDA kernels recorded in a {wall:.3f} s call"]
    key = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
    lines = events.table(sort_by=key, row_limit=top, max_name_column_width=80).splitlines()
    kinds = {  # by kernel name, first match (a heuristic on cuDNN/cuBLAS/Triton naming)
        "attention (SDPA)": ("flash", "fmha", "cudnn", "attention", "sdpa"),
        "triton template (flex attention)": ("triton_tem", "flex"),
        "matmul": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90_", "sm80_"),
        "triton fused (compiled)": ("triton_poi", "triton_red", "triton_per"),
        "optimizer": ("adam", "multi_tensor", "foreach"),
        "elementwise / copies / reductions": ("elementwise", "vectorized", "reduce", "copy", "fill", "index",
                                              "scatter", "gather", "embedding", "cat", "softmax", "memcpy", "memset"),
    }
    spent: dict[str, float] = {}
    for e in events:
        us = getattr(e, key)
        name = e.key.lower()
        kind = next((k for k, marks in kinds.items() if any(m in name for m in marks)), "other")
        spent[kind] = spent.get(kind, 0.0) + us
    busy = max(sum(spent.values()) / 1e6, 1e-9)
    lines.append(f"kernels {busy:.3f} s in a {wall:.3f} s call (GPU busy {busy / wall:.0%}); by kind: " + ", ".join(
        f"{k} {v / 1e6 / busy:.0%}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1])))
    return lines


def idle_gaps(trace: dict, top: int = 20, min_us: float = 20.0) -> list[str]:
    """Where the GPU waits in a Chrome trace of CPU and CUDA events: the gaps between kernels (the union of
    kernel, copy and memset intervals) of at least ``min_us``, summed by the innermost relayrl (else any)
    Python frame running on the host when each gap began: the host work the GPU is waiting for."""
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    dev = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    if not dev:
        return ["no device events in the trace"]
    host = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]) for e in ev
                  if e.get("cat") in ("python_function", "cpu_op"))
    gaps, end = [], dev[0][1]
    for a, b in dev[1:]:
        if a - end >= min_us:
            gaps.append((end, a))
        end = max(end, b)
    span = dev[-1][1] - dev[0][0]
    by: dict[str, list[float]] = {}
    for a, b in gaps:
        inner = [h for h in host if h[0] <= a <= h[1]]
        ours = [h for h in inner if "relayrl" in h[2]] or inner
        name = min(ours, key=lambda h: h[1] - h[0])[2] if ours else "(no host event)"
        by.setdefault(name[:110], []).append(b - a)
    idle = sum(b - a for a, b in gaps)
    lines = [f"GPU idle {idle / 1e3:.1f} ms of {span / 1e3:.1f} ms in {len(gaps)} gaps >= {min_us:.0f} us; by the "
             f"host frame running when each began:"]
    for name, ds in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"{sum(ds) / 1e3:8.2f} ms {len(ds):5d} gaps  {name}")
    return lines


def trace_update(fn, out: Path) -> list[str]:
    """One call of ``fn`` under the profiler with host events and Python frames: the Chrome trace gzipped to
    ``out``, and :func:`idle_gaps` of it."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    raw = out.with_suffix("")
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(out, "wt") as f:
        json.dump(trace, f)
    raw.unlink()
    return idle_gaps(trace)
