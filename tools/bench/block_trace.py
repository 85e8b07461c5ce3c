"""Whole iterations of one taken and one paused block under torch.profiler (``tools/bench/gpu_overhead.py
--interleave K --trace-blocks N``), reduced to the sums that tell the causes of an overhead apart.

On an H200 iterations that take snapshots ran 13.6 % (38 ms) slower than those that do not, in one launch, with
a device stall of 0, while the training thread spent 6.5 ms per iteration in the FT hooks. ``--profile-worker``
and ``--gil-probe`` look at the host threads; this looks at the timeline of both sides at once. It traces ``N``
iterations of the last taken block and ``N`` of the last paused block (never a block's first, which holds one
snapshot and not the other), CPU and CUDA activity together, and writes per kind of block, per iteration:

* ``kernel_ms`` per CUDA stream: the device's work. Kernels on the compute stream that take longer in taken
  blocks mean the snapshot's copies or hash kernels slow the device (memory bandwidth, SMs);
* ``busy_ms`` / ``idle_ms`` of the stream with the most kernel time (the compute stream) over the traced span:
  idle time that grows in taken blocks means the device waited for the host;
* ``memcpy_ms`` per stream and copy kind (the snapshot's device-to-host copies run on a side stream);
* ``cpu_ms`` per host thread (the union of its CPU ops' intervals; ``training`` is the thread that runs the
  iterations), and ``runtime_ms`` with the ``runtime_top`` calls per thread (``cudaLaunchKernel``,
  ``cudaEventSynchronize``, ``cudaHostRegister`` ...): a runtime call of the training thread that takes longer
  in taken blocks (a driver lock another thread holds) shows there.

The profiler records the other threads' CPU ops where the installed torch can (``profile_all_threads``); the
summary says whether it did. Each block's Chrome trace is kept, gzipped, beside the summary
(``trace_<tag>_<kind>.json.gz``, for a look at the timeline). The traced iterations come at the end of the run
and the benchmark's timings stop at the first of them (a traced iteration runs slower).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Iterable

import torch

from tools.bench.interleave import iteration_kind

KINDS = ("active", "paused")


def trace_iterations(*, iters: int, warmup: int, block: int, n: int) -> dict[str, list[int]]:
    """``{kind: iterations}`` of ``--trace-blocks n``: for each kind of block (:data:`KINDS`), the ``n`` iterations
    after the first of the last such block that starts past ``warmup`` and whose traced iterations all have a
    successor (``n`` < ``block``: a block's first counts for neither kind). ``n`` 0: nothing."""
    if n <= 0:
        return {}
    if block <= 0 or n >= block:
        raise ValueError(f"--trace-blocks {n} traces iterations inside one block of --interleave: it needs "
                         f"--interleave > {n} (got {block})")
    out: dict[str, list[int]] = {}
    for start in range((iters - 2 - n) // block * block, warmup - 1, -block):
        its = list(range(start + 1, start + 1 + n))
        kind = iteration_kind(its[0], block)
        if start >= warmup and kind is not None and kind not in out and its[-1] <= iters - 2:
            out[kind] = its
    missing = [kind for kind in KINDS if kind not in out]
    if missing:
        raise ValueError(f"--trace-blocks {n} needs a {' and a '.join(missing)} block of {block} iterations past the "
                         f"warm-up ({warmup}) within {iters} iterations: run more iterations")
    return out


def _union_ms(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (microseconds in), in milliseconds."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def summarize(events: list[dict], iterations: int, *, training_tid: int | None = None,
              thread_names: dict[int, str] | None = None, top: int = 8) -> dict:
    """The sums of the module docstring, per iteration, from a Chrome trace's ``traceEvents`` covering
    ``iterations`` iterations; ``training_tid``: the native id of the thread that ran them (``training``);
    ``thread_names``: names of the other threads by native id (else ``tid <id>``)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    per = 1.0 / max(iterations, 1)
    kernels: dict[str, list[tuple[float, float]]] = defaultdict(list)
    memcpy: dict[str, float] = defaultdict(float)
    cpu: dict[str, list[tuple[float, float]]] = defaultdict(list)
    runtime: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))

    def thread(e: dict) -> str:
        tid = e.get("tid")
        if training_tid is not None and tid == training_tid:
            return "training"
        name = (thread_names or {}).get(tid) if isinstance(tid, int) else None
        return f"{name} ({tid})" if name else f"tid {tid}"

    for e in spans:
        cat, interval = e.get("cat"), (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        stream = f"stream {e.get('args', {}).get('stream', e.get('tid'))}"
        if cat == "kernel":
            kernels[stream].append(interval)
        elif cat in ("gpu_memcpy", "gpu_memset"):
            memcpy[f"{stream} {e.get('name', cat)}"] += float(e["dur"]) / 1e3
        elif cat == "cpu_op":
            cpu[thread(e)].append(interval)
        elif cat in ("cuda_runtime", "cuda_driver"):
            runtime[thread(e)][e.get("name", "?")] += float(e["dur"]) / 1e3
    everything = [s for v in [*kernels.values(), *cpu.values()] for s in v]
    out: dict = {"iterations": iterations,
                 "span_ms": (max(b for _, b in everything) - min(a for a, _ in everything)) / 1e3 * per
                 if everything else 0.0,
                 "kernel_ms": {s: sum(b - a for a, b in v) / 1e3 * per for s, v in sorted(kernels.items())},
                 "kernels": {s: len(v) * per for s, v in sorted(kernels.items())},
                 "memcpy_ms": {k: v * per for k, v in sorted(memcpy.items())},
                 "cpu_ms": {t: _union_ms(v) * per for t, v in sorted(cpu.items())},
                 "runtime_ms": {t: sum(v.values()) * per for t, v in sorted(runtime.items())},
                 "runtime_top": {t: {name: ms * per for name, ms in sorted(v.items(), key=lambda kv: -kv[1])[:top]}
                                 for t, v in sorted(runtime.items())}}
    if kernels:
        compute = max(kernels, key=lambda s: sum(b - a for a, b in kernels[s]))
        busy = _union_ms(kernels[compute])
        first = min(a for a, _ in kernels[compute])
        last = max(b for _, b in kernels[compute])
        out["compute_stream"] = {"stream": compute, "busy_ms": busy * per,
                                 "idle_ms": ((last - first) / 1e3 - busy) * per}
    return out


def _profiler() -> tuple["torch.profiler.profile", bool]:
    """A profiler of CPU (and CUDA where there is one) activity; whether it records every thread's CPU ops."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    try:
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        all_threads = True
    except (AttributeError, TypeError):  # an older torch: the training thread's ops only
        config, all_threads = None, False
    return torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False,
                                  experimental_config=config), all_threads


class BlockTracer:
    """Traces the iterations of ``ranges`` (``{kind: iterations}``, :func:`trace_iterations`), each range under one
    profiler, from the start of its first iteration to the start of the iteration after its last
    (:meth:`on_step_begin`, called on the training thread); writes ``trace_<tag>_<kind>.json.gz`` and rewrites
    ``trace_summary_<tag>.json`` in ``out_dir`` after each range (a run cut short keeps what it traced)."""

    def __init__(self, ranges: dict[str, list[int]], out_dir: str, tag: str) -> None:
        self.starts = {its[0]: kind for kind, its in ranges.items()}
        self.ranges, self.out_dir, self.tag = ranges, out_dir, tag
        self.summary: dict = {}
        self._open: tuple[str, "torch.profiler.profile", bool, float, int] | None = None

    def on_step_begin(self, iteration: int) -> None:
        if self._open is not None and iteration == self.ranges[self._open[0]][-1] + 1:
            self._close()
        kind = self.starts.get(iteration)
        if kind is not None and self._open is None:
            prof, all_threads = _profiler()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the previous iteration's kernels stay out of the trace
            prof.start()
            self._open = (kind, prof, all_threads, time.perf_counter(), threading.get_native_id())

    def _close(self) -> None:
        assert self._open is not None
        kind, prof, all_threads, t0, tid = self._open
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the traced iterations' kernels end inside the trace
        wall_s = time.perf_counter() - t0
        prof.stop()
        self._open = None
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"trace_{self.tag}_{kind}.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
        with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
        its = self.ranges[kind]
        self.summary[kind] = {"traced": its, "wall_ms": 1e3 * wall_s / len(its), "all_threads": all_threads,
                              **summarize(events, len(its), training_tid=tid,
                                          thread_names={t.native_id: t.name for t in threading.enumerate()
                                                        if t.native_id is not None})}
        with open(os.path.join(self.out_dir, f"trace_summary_{self.tag}.json"), "w") as f:
            json.dump(self.summary, f, indent=1)
