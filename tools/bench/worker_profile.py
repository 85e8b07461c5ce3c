"""Where the snapshot engine's background thread spends its time and its CPU (``tools/bench/gpu_overhead.py
--profile-worker N``).

On an H200 iterations that take snapshots ran 13.6 % slower than iterations that do not, in one launch, while
the training thread spent only 6.5 ms per iteration in the FT hooks and the engine's background thread used
28 ms of CPU per snapshot (``SnapshotRecord.thread_cpu_s``). What that CPU is decides the fix: Python work that
holds the GIL the launch-bound training thread needs, a C call that releases it, or a wait that spins a core.
This profile times every sub-step the thread runs for a snapshot, in wall time and in the thread's own CPU time,
keyed by call path (``execute/write/publish/after_publish/gc/retention.keep``) with each path's self time:

* on the GPU path: the wait for the copy event (``event.synchronize``: its CPU shows whether it spins), the
  sealing of the mapped entries (``mapped.seal``: headers, the digests from the device sums, ``mfh64`` of the
  headers on the host), the metadata entry, the manifest and the index, garbage collection;
* on the CPU path (no mapped copier): the store's per-entry ``put`` (checksum and write of the live tensors),
  the metadata entry, the manifest, garbage collection.

A path whose CPU is close to its wall time kept a core busy (Python with the GIL, a C call, or a spin); one with
little CPU slept. Only the snapshots of the ``N`` chosen iterations are profiled: the engine's worker calls a
wrapper for every snapshot, which, for a chosen one, replaces the sub-steps by timing wrappers
(:func:`tools.bench.submit_profile.wrapped`) for the duration of that snapshot and puts them back after it.
Only calls on the background thread are timed (the training thread runs some of the same functions meanwhile).
A profiled snapshot runs slower (a few microseconds per wrapped call): the benchmark leaves the iterations from
the first profiled one on out of its timings.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable

import torch

from moe_ft.snapshot import engine as engine_module
from moe_ft.store import arena, codec, entry_hash, local, manifest, retention
from moe_ft.store import store as store_module
from tools.bench.submit_profile import Breakdown, wrapped


def worker_targets(engine) -> list[tuple[object, str, str | Callable[..., str]]]:
    """``(owner, attribute, name)`` of every call timed below the background thread's ``execute``: the engine's
    steps, the store's and the backend's, the mapped copier's seal, the codec's and the digest's host work."""
    store = engine.store
    backend = store.backend
    out: list[tuple[object, str, str | Callable[..., str]]] = [
        (engine, "_write", "write"), (engine, "_copy_in_bubbles", "copy_in_bubbles"), (engine, "_pause", "pause"),
        (engine_module, "_copy_entries", "copy_entries"), (engine_module, "_put", "put"),
        (store, "begin", "store.begin"), (backend, "begin_point", "begin_point"),
        (backend, "list_points", "list_points"),
        (store_module.PendingPoint, "put", "point.put"), (store_module.PendingPoint, "put_remote", "put_remote"),
        (store_module.PendingPoint, "put_meta", "put_meta"), (store_module.PendingPoint, "publish", "publish"),
        (store_module.ReservedEntry, "seal", "entry.seal"), (store_module, "entry_record", "records"),
        (store_module.ReservedEntry, "hand_off", "entry.hand_off"), (store_module.PendingPoint, "_hand_over",
                                                                     "hand_over"),  # --ft-publish-by agent
        (store_module, "write_entry", "write_entry"), (store_module, "encode_meta", "encode_meta"),
        (store_module, "entry_head", "entry_head"), (store_module, "seal_entry", "seal_entry"),
        (manifest, "sealed_head", "sealed_head"), (manifest, "seal_entry", "seal_entry"),
        (store_module, "entry_digest", "entry_digest"), (codec, "entry_digest", "entry_digest"),
        (store_module, "build_manifest", "build_manifest"),
        (arena._ArenaWriter, "commit", "commit"), (local._LocalWriter, "commit", "commit"),
        (arena, "_write_index", "write_index"),
        (store, "_after_publish", "after_publish"), (store, "gc", "gc"), (store, "_gc_catalog", "gc_catalog"),
        (retention, "newest_recoverable", "newest_recoverable"),
        (backend, "pinned_elsewhere", "pinned_elsewhere"), (backend, "delete_point", "delete_point"),
        (store, "_drop_verified", "drop_verified"), (backend, "sweep_staging", "sweep_staging"),
        (entry_hash.Mfh64, "update", "mfh64.update"), (entry_hash, "zero_word_sums", "zero_word_sums"),
        (entry_hash, "lane_sums_of", "host_lane_sums"), (entry_hash, "bytes_lane_sums", "header_lane_sums"),
        (entry_hash, "words_terms", "header_patch")]
    if store.retention is not None:  # a frozen dataclass: its class is wrapped
        out.append((type(store.retention), "keep", "retention.keep"))
    if engine._pool is not None:  # the write threads' own work is not timed, only the wait for them
        out.append((engine._pool, "map", "pool.map"))
    if engine.mapped is not None:
        out.append((engine.mapped, "seal", "mapped.seal"))
    if torch.cuda.is_available():
        out += [(torch.cuda.Event, "synchronize", "event.synchronize"),
                (torch.cuda.Event, "elapsed_time", "event.elapsed_time")]
    return out


class WorkerProfiler:
    """Profiles the snapshots of ``iterations`` on the engine's background thread (:meth:`attach`); after each
    profiled snapshot ``worker_breakdown_<tag>.json`` and ``worker_profile_<tag>.txt`` in ``out_dir`` are
    rewritten (a run cut short keeps what it profiled)."""

    def __init__(self, iterations: list[int], out_dir: str, tag: str) -> None:
        self.iterations = set(iterations)
        self.out_dir, self.tag = out_dir, tag
        self.breakdown = Breakdown()
        self.jobs: dict[int, dict] = {}
        """Per profiled iteration, what the engine recorded for its snapshot (to compare with the breakdown)."""

    def attach(self, engine) -> None:
        """Wrap the handler of the engine's background worker (it calls the handler it was built with)."""
        worker = engine._worker
        handle = worker._handle

        def profiled_handle(job) -> None:
            iteration = job.record.iteration
            if iteration not in self.iterations:
                return handle(job)
            self.breakdown.owner = threading.get_ident()
            try:
                with wrapped(worker_targets(engine), self.breakdown):
                    self.breakdown.wrap(handle, "execute")(job)
            finally:
                self.breakdown.owner = None
                r = job.record
                self.jobs[iteration] = {"thread_cpu_ms": 1e3 * r.thread_cpu_s, "entries_cpu_ms": 1e3 * r.entries_cpu_s,
                                        "copy_ms": 1e3 * r.copy_s, "write_ms": 1e3 * r.write_s,
                                        "bytes": r.bytes, "published": r.published}
                self._write()

        worker._handle = profiled_handle

    def _write(self) -> None:
        n = len(self.jobs)
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, f"worker_breakdown_{self.tag}.json"), "w") as f:
            json.dump({"snapshots": {str(t): v for t, v in sorted(self.jobs.items())},
                       "breakdown_per_snapshot": self.breakdown.rows(n)}, f, indent=1)
        with open(os.path.join(self.out_dir, f"worker_profile_{self.tag}.txt"), "w") as f:
            f.write("snapshot engine background thread, " + self.breakdown.table(n))
            f.write("\nthe engine's records (thread_cpu_ms includes any write threads' CPU):\n")
            for t, v in sorted(self.jobs.items()):
                f.write(f"  iteration {t}: " + ", ".join(f"{k} {v[k]:.3f}" if isinstance(v[k], float) else f"{k} {v[k]}"
                                                         for k in v) + "\n")
