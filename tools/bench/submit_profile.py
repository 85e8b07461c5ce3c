"""Where the training thread's time inside ``SnapshotEngine.submit`` goes (``tools/bench/gpu_overhead.py
--profile-submit N``).

On an H200 the engine's ``issue_s`` is ~18 ms per iteration for ~600 MB of snapshot, ~200 copies and one
kernel launch, far more than queueing that work should cost. Two views, taken on different iterations so
that neither inflates the other:

* **a breakdown by sub-step** (``submit_breakdown_<tag>.json``, and as text in ``submit_profile_<tag>.txt``)
  on ``N`` iterations, of the runtime's whole ``on_step_end`` (the snapshot plan, the step metadata, the
  components' hooks, the popularity counters, the log line: the rest of the 6.5 ms the training thread spent in
  the FT hooks on the H200, besides ``submit``'s 3.1 ms) and, nested in it, ``perf_counter`` around the engine's steps and the store and copier calls they make
  (free slot, per-operator entries, metadata capture, the mapped path's ``store.begin``, region ``reserve``,
  ``byte_views``, the batched ``_foreach_copy_``, the hash plan, the Triton launch, event records), keyed by
  the call path (``submit/issue_mapped/mapped.issue/reserve``), with each path's self time;
* **torch.profiler** (CPU, and CUDA when available; no shapes, no stacks) around ``submit`` on the next
  ``N`` iterations: the top ops by self CPU time per iteration (``submit_profile_<tag>.txt``) and summed
  (``top_ops`` in the JSON file). A host-blocking call (a ``cudaStreamSynchronize`` or a synchronous
  ``cudaMemcpy``) shows there by name.

The engine's code is not changed: for the profiled iterations only, its methods and the functions it calls are
replaced by timing wrappers (on the instance, or on the class or module and restored right after), and only
calls on the training thread are timed (the snapshot thread runs the same functions meanwhile). Profiled
iterations run slower; the benchmark leaves them, and every iteration after them, out of its timings.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from moe_ft.store import arena
from moe_ft.store import store as store_module

_MISSING = object()
_SUMMED = ("count", "self_cpu_us", "cpu_us", "self_device_us")
"""The summed columns of the profiler's ops (divided by the profiled iterations when written)."""


class Breakdown:
    """Wall seconds, CPU seconds (``time.thread_time``) and calls per call path, on one thread (``owner``: the
    training thread's for ``submit``, the engine's background thread's in ``tools/bench/worker_profile.py``).
    A path whose CPU is close to its wall time kept a core busy (Python, a C call, or a spin); one with little
    CPU slept (a blocking wait, I/O)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.cpu_seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.owner: int | None = None
        self._stack: list[str] = []

    def wrap(self, fn: Callable, name: str | Callable[..., str]) -> Callable:
        """``fn`` timed under ``name`` (or ``name(*args, **kwargs)``) below the path of the timed calls it is
        made from; calls from other threads run untimed."""

        def timed(*args, **kwargs):
            if threading.get_ident() != self.owner:
                return fn(*args, **kwargs)
            self._stack.append(name(*args, **kwargs) if callable(name) else name)
            path = "/".join(self._stack)
            cpu0, start = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[path] += time.perf_counter() - start
                self.cpu_seconds[path] += time.thread_time() - cpu0
                self.calls[path] += 1
                self._stack.pop()

        return timed

    def rows(self, iterations: int) -> list[dict]:
        """Per path (sorted, so a path's children follow it): ms, CPU ms and calls per iteration, and the self
        ms and self CPU ms (less the paths directly below it)."""
        child_s: dict[str, float] = defaultdict(float)
        child_cpu: dict[str, float] = defaultdict(float)
        for path, s in self.seconds.items():
            if "/" in path:
                child_s[path.rsplit("/", 1)[0]] += s
                child_cpu[path.rsplit("/", 1)[0]] += self.cpu_seconds[path]
        return [{"path": path, "calls": self.calls[path] / iterations, "ms": 1e3 * s / iterations,
                 "self_ms": 1e3 * (s - child_s[path]) / iterations,
                 "cpu_ms": 1e3 * self.cpu_seconds[path] / iterations,
                 "self_cpu_ms": 1e3 * (self.cpu_seconds[path] - child_cpu[path]) / iterations}
                for path, s in sorted(self.seconds.items())]

    def table(self, iterations: int) -> str:
        """:meth:`rows` as text, one path a line."""
        lines = [f"per iteration, over {iterations} iteration(s): inclusive ms, self ms, inclusive CPU ms, self CPU "
                 "ms, calls, path"]
        for r in self.rows(iterations) if iterations else []:
            lines.append(f"  {r['ms']:9.3f} {r['self_ms']:9.3f} {r['cpu_ms']:9.3f} {r['self_cpu_ms']:9.3f} "
                         f"{r['calls']:7.1f}  {r['path']}")
        return "\n".join(lines) + "\n"


def _foreach_name(*args, **kwargs) -> str:
    return "foreach_copy_(non_blocking)" if kwargs.get("non_blocking") else "foreach_copy_"


def _targets(engine) -> list[tuple[object, str, str | Callable[..., str]]]:
    """``(owner, attribute, name)`` of every call timed in the breakdown below ``submit``: the engine's steps,
    the store's and the mapped copier's, and the torch calls that queue work."""
    out: list[tuple[object, str, str | Callable[..., str]]] = [
        (engine._free, "get", "free_slot"), (engine, "_lay_out", "lay_out"), (engine, "_entry", "entry"),
        (engine, "_stage_meta", "stage_meta"), (engine, "_issue_mapped", "issue_mapped"),
        (engine, "_copy_on_stream", "copy_on_stream"), (engine._worker, "submit", "worker.submit"),
        (engine.store, "begin", "store.begin"), (engine.store.backend, "has_point", "has_point"),
        (engine.store.backend, "begin_point", "begin_point"), (arena._ArenaWriter, "map_blobs", "map_blobs"),
        (store_module.PendingPoint, "reserve_all", "reserve_all"), (store_module.PendingPoint, "layout", "layout"),
        (store_module.ReservedEntry, "byte_views", "byte_views"),
        (torch, "_foreach_copy_", _foreach_name)]
    mapped = engine.mapped
    if mapped is not None:
        # start-up time: triton is imported by the mapped path only (CUDA registries); it is loaded by now
        from moe_ft.store import entry_hash_triton

        out += [(mapped, "issue", "mapped.issue"), (mapped, "_prep", "prep"), (mapped, "_plan", "hash_plan"),
                (mapped, "_slot_rows", "slot_rows"), (mapped, "_hash", "hash"),
                (mapped.pinned, "refresh", "pinned.refresh"),
                (entry_hash_triton.TensorTable, "launch", "table.launch"),
                (entry_hash_triton, "device_lane_sums", "device_lane_sums")]
    if torch.cuda.is_available():
        out += [(torch.cuda.Event, "record", "event.record"), (torch.cuda.Stream, "wait_stream", "wait_stream")]
    return out


def _hook_targets(runtime) -> list[tuple[object, str, str | Callable[..., str]]]:
    """The training thread's FT work in ``FTRuntime.on_step_end`` besides ``submit``: the snapshot plan, the
    step metadata, the components' hooks (by class), the popularity counters, the clock, the log line."""
    from moe_ft.runtime import hooks as hooks_module

    out: list[tuple[object, str, str | Callable[..., str]]] = [
        (runtime, "_snapshot", "_snapshot"), (runtime, "_log", "log_line"), (runtime, "select_session", "select_session"),
        (runtime.popularity, "end_iteration", "popularity.end_iteration"), (runtime.clock, "tick", "clock.tick"),
        (runtime.popularity, "mark_full", "popularity.mark_full"), (runtime, "check_fault", "check_fault"),
        (hooks_module, "capture_step_meta", "capture_step_meta")]
    if runtime.active is not None:
        out.append((runtime.active.policy, "plan", "policy.plan"))
    if runtime.survivor is not None:
        out.append((runtime.survivor, "completed", "survivor.completed"))
    for component in runtime.components:
        for attr in ("on_iteration_end", "snapshot_tensors", "remote_full", "after_snapshot", "after_iteration"):
            if callable(getattr(component, attr, None)):
                out.append((component, attr, f"{type(component).__name__}.{attr}"))
    return out


@contextlib.contextmanager
def wrapped(targets, breakdown: Breakdown) -> Iterator[None]:
    """Every target replaced by its timed wrapper inside the block (a class keeps its function, an instance or
    a module gets an attribute of its own), each put back on exit."""
    saved = []
    try:
        for owner, attr, name in targets:
            # a class's own function (from the class that defines it), so that the wrapper binds as it did
            fn = (next(vars(c)[attr] for c in owner.__mro__ if attr in vars(c)) if isinstance(owner, type)
                  else getattr(owner, attr))
            saved.append((owner, attr, vars(owner).get(attr, _MISSING)))
            setattr(owner, attr, breakdown.wrap(fn, name))
        yield
    finally:
        for owner, attr, before in reversed(saved):
            if before is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, before)


class SubmitProfiler:
    """Wraps ``engine.submit`` (:meth:`attach`): the breakdown on ``breakdown_its``, torch.profiler on
    ``profiler_its``; after each profiled iteration the files in ``out_dir`` are rewritten (a run cut short
    keeps what it profiled)."""

    def __init__(self, breakdown_its: list[int], profiler_its: list[int], out_dir: str, tag: str) -> None:
        self.breakdown_its, self.profiler_its = set(breakdown_its), set(profiler_its)
        self.out_dir, self.tag = out_dir, tag
        self.breakdown = Breakdown()
        self.tables: list[str] = []
        self.top: dict[str, dict] = {}
        self.issue_s: dict[str, dict[int, float]] = {"breakdown": {}, "profiler": {}}
        self._in_step_end = False  # inside a broken-down on_step_end: submit leaves the writing to it

    def attach(self, engine) -> None:
        submit = engine.submit

        def profiled_submit(iteration, *args, **kwargs):
            if iteration in self.breakdown_its:
                self.breakdown.owner = threading.get_ident()
                with wrapped(_targets(engine), self.breakdown):
                    record = self.breakdown.wrap(submit, "submit")(iteration, *args, **kwargs)
                self.issue_s["breakdown"][iteration] = record.issue_s
            elif iteration in self.profiler_its:
                record = self._profiled(iteration, submit, args, kwargs)
                self.issue_s["profiler"][iteration] = record.issue_s
            else:
                return submit(iteration, *args, **kwargs)
            if not self._in_step_end:  # else written once on_step_end returns (not timed as its own work)
                self._write()
            return record

        engine.submit = profiled_submit

    def attach_runtime(self, runtime) -> None:
        """Also break down the rest of the training thread's FT work on the breakdown iterations: the whole
        ``on_step_end`` (its ``submit`` nested under it, ``on_step_end/_snapshot/submit/...``)."""
        step_end = runtime.on_step_end
        if getattr(step_end, "profiled", False):  # a rebuilt engine: the runtime is wrapped already
            return

        def profiled_step_end(iteration, result):
            if iteration not in self.breakdown_its:
                return step_end(iteration, result)
            self.breakdown.owner = threading.get_ident()
            self._in_step_end = True
            try:
                with wrapped(_hook_targets(runtime), self.breakdown):
                    out = self.breakdown.wrap(step_end, "on_step_end")(iteration, result)
            finally:
                self._in_step_end = False
            self._write()
            return out

        profiled_step_end.profiled = True  # type: ignore[attr-defined]
        runtime.on_step_end = profiled_step_end

    def _profiled(self, iteration: int, submit, args, kwargs):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False) as prof:
            record = submit(iteration, *args, **kwargs)
        averages = prof.key_averages()
        self.tables.append(f"--- torch.profiler around submit of iteration {iteration} (issue_s "
                           f"{1e3 * record.issue_s:.3f} ms)\n"
                           + averages.table(sort_by="self_cpu_time_total", row_limit=30))
        for evt in averages:
            row = self.top.setdefault(evt.key, {"op": evt.key, **{key: 0.0 for key in _SUMMED}})
            row["count"] += evt.count
            row["self_cpu_us"] += evt.self_cpu_time_total
            row["cpu_us"] += evt.cpu_time_total
            row["self_device_us"] += evt.self_device_time_total
        return record

    def _write(self) -> None:
        n_breakdown = len(self.issue_s["breakdown"])
        n_profiled = max(1, len(self.issue_s["profiler"]))
        rows = self.breakdown.rows(n_breakdown) if n_breakdown else []
        top = [{**row, **{key: row[key] / n_profiled for key in _SUMMED}}
               for row in sorted(self.top.values(), key=lambda r: -r["self_cpu_us"])[:30]]
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"submit_breakdown_{self.tag}.json"), "w") as f:
            json.dump({"issue_ms": {k: {str(t): 1e3 * s for t, s in v.items()} for k, v in self.issue_s.items()},
                       "breakdown_per_iteration": rows, "top_ops_per_iteration": top}, f, indent=1)
        with open(os.path.join(self.out_dir, f"submit_profile_{self.tag}.txt"), "w") as f:
            f.write("breakdown of the FT hooks' on_step_end and submit " + self.breakdown.table(n_breakdown))
            f.write("\n" + "\n\n".join(self.tables) + "\n")
