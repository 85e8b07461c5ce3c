"""Iteration-time overhead of ``--ft-policy sparse`` against ``--ft-policy none`` on one GPU (goal:
ratio <= 1.01), both launched by this one command, alternating.

    python -m tools.bench.gpu_overhead [--iters 40] [--repeats 1] [--windows 0 --snapshot-bandwidth 2e9]
    python -m tools.bench.gpu_overhead --windows 8 16      # none, sparse W=8, sparse W=16
    python -m tools.bench.gpu_overhead --windows 8 --interleave 8 --profile-submit 3 --log-dir out
    python -m tools.bench.gpu_overhead --windows 8 --interleave 8 --profile-worker 3 --gil-probe --log-dir out

Each launch is ``torchrun --nproc-per-node 1`` of the real entry point (``pretrain_gpt_moe.py`` flags, an
MoE GPT big enough to keep an H100 busy: 4 layers, hidden 1024, 8 experts top-2, seq 1024, bf16, 4
micro-batches of 4). The worker wraps the FT runtime's hooks to time every iteration from the start of
one to the start of the next (forward/backward, optimizer, the FT hook: plan, metadata, submit, stall);
the loop's own host syncs (``float(loss)``, grad norm) end each iteration. The first ``--warmup``
iterations are dropped. Prints one JSON object: per policy the median iteration seconds and the
snapshot engine's records (bytes, host wait, device stall, copy and store-write times), and
``overhead_ratio`` = median(sparse) / median(none) (medians over launches when ``--repeats`` > 1), one
per sparse window of ``--windows`` (keyed ``sparse(W=…)``). ``ft_hooks_ms``: the median host time the
training thread spent inside the FT hooks per iteration (plan, metadata, submit, waits, the log line). ``--windows 0`` lets FindWindowSize (MoEvement Alg. 1) pick W from ``--snapshot-bandwidth``: pass the
bandwidth the snapshot path sustains end to end on this machine (the store write, not PCIe, is the
narrow part: ``tools/bench/gpu_snapshot.py`` reports both).

``--interleave K``: every launch alternates blocks of ``K`` iterations with snapshots taken and paused
(``tools/bench/interleave.py``: a paused iteration takes none, as ``--ft-policy none``; ``K`` a multiple of
the window); each variant's ``interleaved`` holds ``active_median_s``, ``paused_median_s``, their ``ratio``
(the overhead measured inside one process, free of the launch-to-launch spread), the blocks counted and
``host_s_per_snapshot`` (their difference: the simulator's per-snapshot host cost, docs/simulator.md);
``median_iter_s`` of a sparse launch is then its active blocks' median. The ``none`` launch gets the same
split of its iterations (``control``: its ratio shows the method's own noise). The launches then recover
globally (``--ft-recovery-scope global``): the localized scope's survivor guard follows every snapshot, and
``none`` runs without it anyway.

``--profile-submit N``: where the training thread's time in the engine's ``submit`` goes
(``tools/bench/submit_profile.py``): a breakdown by sub-step on ``N`` iterations and torch.profiler's top ops
on ``N`` more, written to ``--log-dir``; they are the last iterations with snapshots, and the timings stop at
the first of them (``measured_end``).

``--trace-blocks N`` (with ``--interleave K``, ``N`` < ``K``): ``N`` iterations of the last taken block and of the
last paused block of each sparse launch under torch.profiler, CPU and CUDA together (``tools/bench/block_trace.py``):
per kind of block the device's kernel time per stream, the compute stream's busy and idle time, each host
thread's CPU and CUDA runtime calls, per iteration (``trace`` in the launch's summary; the gzipped Chrome traces
in ``--log-dir``); the timings stop at the first traced iteration.

``--profile-worker N``: where the snapshot engine's background thread spends its time and its CPU
(``tools/bench/worker_profile.py``): a breakdown by sub-step, wall and thread CPU, of the snapshots of the last
``N`` iterations with snapshots, written to ``--log-dir`` (``worker_profile_<tag>.txt``); the timings stop at the
first of them. Not with ``--profile-submit`` in the same run (both replace the store's functions for a while).

``--gil-probe [SLEEP_S]``: a thread in each worker process sleeps ``SLEEP_S`` (0.5 ms) in a loop and records how
late it wakes, the time some other thread held the GIL (``tools/bench/gil_probe.py``, which documents its cost); each launch's
summary has the lags per kind of block (``interleaved.gil_probe``: p50/p99/max and the lag summed per iteration)
and the probe's own CPU (``gil_probe_cpu_share``). ``--switch-interval S``: ``sys.setswitchinterval(S)`` in the
worker processes (Python's default: 0.005 s). A thread that runs Python keeps the GIL for up to S while the
training thread waits to launch its next kernel; if the snapshot threads' Python work slows training that way,
the interleaved ratio moves with S (e.g. 0.0005 against the default), and the probe's lags in the taken
blocks shrink with it. ``--skip-none``: no ``none`` launch (no ``overhead_ratio``; the interleaved ratio of the
sparse launches needs none).

``--steps copy hash``: also, per sparse window, a launch whose snapshots stop after the device-to-host copy
(``copy``) and one that stops after the device hash (``hash``) (``tools/bench/snapshot_steps.py``: nothing is
published); with ``--interleave`` each launch's ratio is what the steps up to it cost, the plain sparse launch
being the whole path (copy, hash, publish). ``--paced MB``: also, per sparse window, a launch with
``--ft-snapshot-copy-piece-mb MB`` (the copy in pieces, ``moe_ft/snapshot/pacing.py``). ``--kernel-copy N...``:
also, per sparse window and N, a launch with ``--ft-snapshot-copy-by kernel --ft-snapshot-copy-programs N`` (the
hash kernel copies into the arena on N programs, ``moe_ft/snapshot/mapped.py``).

Every launch also times Python's cyclic garbage collections per iteration (``tools/bench/gc_times.py``): ``gc``
(per kind of block in ``interleaved.gc``) holds the milliseconds in collections per iteration and the full
collections per 100 iterations. A collection holds the GIL whichever thread triggered it, so snapshot work that
allocates can stop the training thread that way too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tools.bench.block_trace import BlockTracer, trace_iterations
from tools.bench.gc_times import GcTimes, gc_stats
from tools.bench.gil_probe import GilProbe, lag_stats
from tools.bench.interleave import (
    interleaved_stats,
    iteration_kind,
    last_snapshot_iterations,
    profile_iterations,
    snapshots_paused,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--ffn-hidden-size", "4096",
         "--seq-length", "1024", "--max-position-embeddings", "1024", "--num-experts", "8", "--moe-router-topk", "2",
         "--moe-token-dispatcher-type", "alltoall", "--micro-batch-size", "4", "--global-batch-size", "16",
         "--bf16", "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
         "--weight-decay", "0.01", "--clip-grad", "1.0", "--seed", "1234", "--split", "98,2,0",
         "--tokenizer-type", "ByteLevel", "--eval-interval", "0", "--no-deterministic"]


class _Timed:
    """The runtime's hooks plus a clock at every ``on_step_begin`` (duck-typed ``StepHooks``), and the host
    time the training thread spends inside the FT hooks of each iteration (``hook_s``: where an overhead that
    is not the snapshot threads' comes from)."""

    def __init__(self, runtime, out: str, facts: dict, probe: GilProbe | None = None,
                 tracer: BlockTracer | None = None) -> None:
        self.runtime, self.out, self.facts, self.probe, self.tracer = runtime, out, facts, probe, tracer
        self.gc = GcTimes().install()
        self.starts: list[float] = []
        self.hook_s: list[float] = []
        self.begins: list[int] = []

    def __getattr__(self, name):
        return getattr(self.runtime, name)

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            if self.hook_s:
                self.hook_s[-1] += time.perf_counter() - t0

    def on_step_begin(self, iteration: int) -> None:
        if self.tracer is not None:  # before the clock: ending a trace takes a while (traced: not timed)
            self.tracer.on_step_begin(iteration)
        self.starts.append(time.perf_counter())
        self.hook_s.append(0.0)
        self.begins.append(iteration)
        self.gc.iteration = iteration
        self._timed(self.runtime.on_step_begin, iteration)

    def before_optimizer_step(self, iteration: int) -> None:
        self._timed(self.runtime.before_optimizer_step, iteration)

    def on_step_end(self, iteration: int, result) -> None:
        self._timed(self.runtime.on_step_end, iteration, result)

    def after_log(self, iteration: int) -> None:
        self._timed(self.runtime.after_log, iteration)

    def on_train_end(self, report) -> None:
        self.starts.append(time.perf_counter())
        self.runtime.on_train_end(report)  # flushes and closes the engine: its records are final
        session = getattr(self.runtime, "active", None)
        engine = getattr(session, "engine", None)
        records = [dict(vars(r)) for r in engine.records] if engine is not None else []
        policy = getattr(session, "policy", None)
        probe = {}
        if self.probe is not None:
            self.probe.stop()
            probe = {"gil_lag_us": self.probe.lags_by_interval(self.starts),
                     "gil_probe": {"cpu_s": self.probe.cpu_s, "wall_s": self.probe.wall_s}}
        with open(self.out, "w") as f:
            mapped = getattr(engine, "mapped", None)
            json.dump({"iteration_s": [b - a for a, b in zip(self.starts, self.starts[1:])], "records": records,
                       "hook_s": self.hook_s, "begins": self.begins,
                       "gc_s": [self.gc.seconds.get(t, 0.0) for t in self.begins],
                       "gc_full": [self.gc.full.get(t, 0) for t in self.begins],
                       "paused": getattr(self.runtime, "paused", []), **self.facts,
                       "window": getattr(policy, "window_length", None),
                       "path": "mapped" if mapped is not None else f"staged ({getattr(engine, 'mapped_off', '')})",
                       "pinning": mapped.pinned.failed or "ok" if mapped is not None else "",
                       "switch_interval_s": sys.getswitchinterval(), **probe,
                       # --ft-publish-by agent: the points the node agent published, its CPU per iteration
                       "agent": session.metrics() if hasattr(session, "metrics") else {},
                       "trace": self.tracer.summary if self.tracer is not None else None}, f)


def _pop(argv: list[str], flag: str) -> str:
    value = argv.pop(argv.index(flag) + 1)
    argv.remove(flag)
    return value


def worker(argv: list[str]) -> int:
    sys.path.insert(0, ROOT)
    import pretrain_gpt_moe
    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain
    from moe_ft.compat import activate_all
    from moe_ft.persist.component import Durable
    from moe_ft.replication.component import Replicas
    from moe_ft.runtime.hooks import FTRuntime
    from tools.bench.snapshot_steps import limit_to_step
    from tools.bench.submit_profile import SubmitProfiler
    from tools.bench.worker_profile import WorkerProfiler

    out = _pop(argv, "--out")
    block, warmup = int(_pop(argv, "--bench-interleave")), int(_pop(argv, "--bench-warmup"))
    num_profiled, profile_dir = int(_pop(argv, "--bench-profile-submit")), _pop(argv, "--bench-profile-dir")
    num_worker, switch = int(_pop(argv, "--bench-profile-worker")), float(_pop(argv, "--bench-switch-interval"))
    probe_sleep = float(_pop(argv, "--bench-gil-probe"))
    num_traced = int(_pop(argv, "--bench-trace-blocks"))
    step = _pop(argv, "--bench-snapshot-step") if "--bench-snapshot-step" in argv else "publish"
    probe = GilProbe(probe_sleep) if probe_sleep > 0 else None
    if switch > 0:
        sys.setswitchinterval(switch)
    args = parse_args(argv, extra_groups=pretrain_gpt_moe.extra_argument_groups())
    config = args.extra["FTConfig"]
    iters = args.training.train_iters
    breakdown_its, profiler_its = profile_iterations(iters=iters, warmup=warmup, block=block, n=num_profiled)
    profiler = SubmitProfiler(breakdown_its, profiler_its, profile_dir, config.snapshot.job_id) if num_profiled else None
    worker_its = last_snapshot_iterations(iters=iters, warmup=warmup, block=block, n=num_worker,
                                          what=f"--profile-worker {num_worker}")
    worker_profiler = WorkerProfiler(worker_its, profile_dir, config.snapshot.job_id) if num_worker else None
    traced = trace_iterations(iters=iters, warmup=warmup, block=block, n=num_traced)
    tracer = BlockTracer(traced, profile_dir, config.snapshot.job_id) if traced else None

    class Bench(FTRuntime):
        """The FT runtime as ``pretrain_gpt_moe.step_hooks`` builds it under torchrun (no survivor point carried
        in, no regroup), with ``--interleave``'s paused blocks: no session for a paused iteration (what the runtime
        runs under ``--ft-policy none``), so it publishes no point; the sparse windows it skips are not
        complete in the store and never become recovery points (``SparseWindowRule``), as with a point
        skipped for a full store. With ``--profile-submit`` the engine's ``submit`` is wrapped."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self.paused: list[int] = []
            """The iterations whose snapshot was skipped (paused blocks)."""

        def build(self, t_iter_s: float) -> None:
            super().build(t_iter_s)
            # each of these follows every snapshot: the survivor guard ends the optimizer step's critical section
            # when the snapshot captures the iteration's metadata (a paused block would leave it open)
            needs_every = [name for name, on in (("the survivor guard (--ft-recovery-scope localized)", self.survivor),
                                                 ("the durable tier", self.find(Durable)),
                                                 ("replicas", self.find(Replicas))) if on]
            if block and needs_every:
                raise ValueError(f"--interleave pauses snapshots, and {', '.join(needs_every)} follow every one")
            if profiler is not None and self.active is not None:
                profiler.attach(self.active.engine)
                profiler.attach_runtime(self)
            if worker_profiler is not None and self.active is not None:
                worker_profiler.attach(self.active.engine)
            if self.active is not None:
                limit_to_step(self.active.engine, step)

        def select_session(self, iteration: int):
            session = super().select_session(iteration)
            if session is not None and snapshots_paused(iteration, block):
                self.paused.append(iteration)
                return None
            return session

    activate_all()  # as pretrain_gpt_moe.main does (on CUDA the CPU layer stays off)
    traced_its = [t for its in traced.values() for t in its]
    facts = {"interleave": block, "profiled": {"breakdown": breakdown_its, "profiler": profiler_its,
                                               "worker": worker_its, "traced": traced_its},
             "measured_end": min(breakdown_its + worker_its + traced_its, default=None)}
    if probe is not None:
        probe.start()
    pretrain(args, hooks=_Timed(Bench(config), out, facts, probe, tracer))
    return 0


def _summary(run: dict, warmup: int) -> dict:
    """One launch's numbers over its measured iterations: past ``warmup``, before ``measured_end``."""
    begins = run.get("begins") or list(range(len(run["iteration_s"])))
    end = run.get("measured_end")
    times = {t: s for t, s in zip(begins, run["iteration_s"]) if t >= warmup and (end is None or t < end)}
    hooks = {t: h for t, h in zip(begins, run.get("hook_s", [])) if t in times}
    recs = [r for r in run["records"] if r["iteration"] in times]
    block = run.get("interleave", 0)
    interleaved = None
    if block:
        interleaved = interleaved_stats(times, block, hook_s=hooks,
                                        snapshot_iterations=frozenset(r["iteration"] for r in recs))
        interleaved["control"] = not run.get("paused")  # nothing was paused: no snapshots in either kind
    if interleaved is not None and not interleaved["control"]:  # the iterations that took snapshots
        measured = [t for t in times if iteration_kind(t, block) == "active"]
    else:
        measured = list(times)
    out = {"median_iter_s": statistics.median(times[t] for t in measured), "iterations": len(measured),
           "window": run["window"], "path": run.get("path"), "pinning": run.get("pinning"),
           "ft_hooks_ms": 1e3 * statistics.median(hooks[t] for t in measured) if hooks else None,
           "measured_end": end}
    if run.get("gil_lag_us") is not None:
        lags = {t: lag for t, lag in zip(begins, run["gil_lag_us"]) if t in times}
        gil = lag_stats(lags, block)
        if interleaved is not None:
            interleaved["gil_probe"] = gil
        else:
            out["gil_probe"] = gil
        out["gil_probe_cpu_share"] = run["gil_probe"]["cpu_s"] / max(run["gil_probe"]["wall_s"], 1e-9)
    if run.get("gc_s") is not None:
        gc_times = gc_stats(dict(zip(begins, run["gc_s"])), dict(zip(begins, run["gc_full"])), times, block)
        if interleaved is not None:
            interleaved["gc"] = gc_times
        else:
            out["gc"] = gc_times
    out["switch_interval_s"] = run.get("switch_interval_s")
    if run.get("agent"):
        out["agent"] = run["agent"]
    if interleaved is not None:
        out["interleaved"] = interleaved
        if run["window"]:
            out["whole_windows"] = block % run["window"] == 0
    if any(run.get("profiled", {}).get(k) for k in ("profiler", "worker", "traced")):
        out["profiled"] = run["profiled"]
    if run.get("trace"):
        out["trace"] = run["trace"]
    if recs:
        dev = [r["device_stall_s"] for r in recs if r.get("device_stall_s") is not None]
        out.update(bytes_per_iter=int(statistics.mean(r["bytes"] for r in recs)),
                   host_stall_median_ms=1e3 * statistics.median(r["stall_s"] for r in recs),
                   host_stall_max_ms=1e3 * max(r["stall_s"] for r in recs),
                   device_stall_median_ms=1e3 * statistics.median(dev) if dev else None,
                   device_stall_max_ms=1e3 * max(dev) if dev else None,
                   copy_ms=1e3 * statistics.median(r["copy_s"] for r in recs),
                   issue_ms=1e3 * statistics.median(r.get("issue_s", 0.0) for r in recs),
                   store_write_ms=1e3 * statistics.median(r["write_s"] for r in recs),
                   thread_cpu_ms=1e3 * statistics.median(r.get("thread_cpu_s", 0.0) for r in recs),
                   trainer_payload_bytes_per_byte=max(
                       r.get("host_bytes_touched", 0) / max(1, r["bytes"] + r.get("remote_bytes", 0)) for r in recs),
                   published=sum(bool(r.get("published")) and not r.get("skipped") for r in recs))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1, help="launches per policy (alternating none, sparse)")
    p.add_argument("--windows", type=int, nargs="+", default=[0],
                   help="--ft-sparse-window of each sparse launch (0: FindWindowSize)")
    p.add_argument("--snapshot-bandwidth", type=float, default=25e9, help="--ft-snapshot-bandwidth (bytes/s)")
    p.add_argument("--data-path", default=None)
    p.add_argument("--store-root", default="/dev/shm")
    p.add_argument("--log-dir", default=None, help="keep each launch's log and summary here")
    p.add_argument("--staged", action="store_true",
                   help="also each sparse window on the staged path (--no-ft-snapshot-direct-write: pinned slot "
                        "buffers, host checksum and store write), alternating with the default path")
    p.add_argument("--tiny", action="store_true", help="the drill's tiny model instead (a CPU check of this script)")
    p.add_argument("--interleave", type=int, default=0, metavar="K",
                   help="in every launch, alternate blocks of K iterations with snapshots taken and paused (a "
                        "multiple of each sparse window); 0: off")
    p.add_argument("--profile-submit", type=int, default=0, metavar="N",
                   help="profile the engine's submit on the training thread (a breakdown on N iterations, "
                        "torch.profiler on N more, at the end of each sparse launch) into --log-dir; 0: off")
    p.add_argument("--profile-worker", type=int, default=0, metavar="N",
                   help="profile the snapshot engine's background thread (wall and CPU by sub-step) on the last N "
                        "iterations with snapshots of each sparse launch, into --log-dir; 0: off")
    p.add_argument("--trace-blocks", type=int, default=0, metavar="N",
                   help="with --interleave K (N < K): N iterations of the last taken and the last paused block of each "
                        "sparse launch under torch.profiler, CPU and CUDA, summed per kind of block, into --log-dir; "
                        "0: off")
    p.add_argument("--gil-probe", type=float, nargs="?", const=0.0005, default=0.0, metavar="SLEEP_S",
                   help="record how long other threads hold the GIL (a thread sleeping SLEEP_S, 0.0005 if not given, in "
                        "a loop), per kind of interleaved block; off by default")
    p.add_argument("--switch-interval", type=float, default=0.0, metavar="S",
                   help="sys.setswitchinterval(S) in the worker processes; 0: Python's default (0.005 s)")
    p.add_argument("--paced", type=int, default=0, metavar="MB",
                   help="also each sparse window with its device-to-host copy in pieces of MB MiB "
                        "(--ft-snapshot-copy-piece-mb), alternating with the default (one copy)")
    p.add_argument("--kernel-copy", type=int, nargs="+", default=[], metavar="PROGRAMS",
                   help="also each sparse window copied by the hash kernel on PROGRAMS programs (--ft-snapshot-copy-by "
                        "kernel --ft-snapshot-copy-programs PROGRAMS; 0: one per block), one launch per count")
    p.add_argument("--publish-agent", action="store_true",
                   help="also each --kernel-copy launch with its points sealed and published by the node agent "
                        "(--ft-publish-by agent: no snapshot Python in the trainer after the copy but the hand-over)")
    p.add_argument("--steps", nargs="+", default=[], choices=["copy", "hash"],
                   help="also each sparse window with its snapshots cut after a step (tools/bench/snapshot_steps.py: "
                        "'copy' only, or 'hash' after it; nothing published), one launch per step: with --interleave, "
                        "each launch's ratio is what the steps up to it cost")
    p.add_argument("--skip-none", action="store_true", help="no --ft-policy none launch (no overhead_ratio)")
    p.add_argument("--skip-default", action="store_true",
                   help="no launch of the default snapshot copy (one DMA copy per snapshot): only the variants "
                        "--staged, --paced, --kernel-copy and --steps ask for, with more iterations in the same time")
    a = p.parse_args(argv)
    if min(a.interleave, a.profile_submit, a.profile_worker, a.trace_blocks, a.switch_interval, a.gil_probe,
           a.paced, *a.kernel_copy) < 0:
        p.error("--interleave, --profile-submit, --profile-worker, --trace-blocks, --switch-interval, --gil-probe, "
                "--paced and --kernel-copy take values >= 0")
    if not os.path.isdir(a.store_root):
        p.error(f"--store-root {a.store_root} is not a directory (a tmpfs such as /dev/shm, where the stores go)")
    if a.publish_agent and not a.kernel_copy:
        p.error("--publish-agent adds a launch to each --kernel-copy launch: name --kernel-copy PROGRAMS")
    if a.skip_default and not (a.staged or a.paced or a.kernel_copy or a.steps):
        p.error("--skip-default leaves no snapshot launch: add --staged, --paced, --kernel-copy or --steps")
    if a.profile_submit and a.profile_worker:
        p.error("--profile-submit and --profile-worker both replace the store's functions while they profile: run "
                "them in separate commands")
    if a.interleave and any(w and a.interleave % w for w in a.windows):
        p.error(f"--interleave {a.interleave} is not a multiple of every sparse window {a.windows}: a paused block "
                "would cut a window (each operator is FULL once per window)")
    if (a.profile_submit or a.profile_worker or a.trace_blocks) and not a.log_dir:
        p.error("--profile-submit, --profile-worker and --trace-blocks write their tables into --log-dir: name one")
    try:  # enough iterations for the profiles and the timings (which end where the profiled iterations start)
        profiled, _ = profile_iterations(iters=a.iters, warmup=a.warmup, block=a.interleave, n=a.profile_submit)
        profiled += last_snapshot_iterations(iters=a.iters, warmup=a.warmup, block=a.interleave,
                                             n=a.profile_worker, what=f"--profile-worker {a.profile_worker}")
        profiled += [t for its in trace_iterations(iters=a.iters, warmup=a.warmup, block=a.interleave,
                                                   n=a.trace_blocks).values() for t in its]
        if a.interleave:
            interleaved_stats({t: 1.0 for t in range(a.warmup, min(profiled, default=a.iters))}, a.interleave)
    except ValueError as e:
        p.error(str(e))
    if a.log_dir:
        os.makedirs(a.log_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_overhead_") as tmp, \
            tempfile.TemporaryDirectory(prefix="moe_ft_gpu_overhead_", dir=a.store_root) as store:
        data = a.data_path
        if data is None:
            sys.path.insert(0, ROOT)
            from tools.preprocess_data import generated_dataset

            data = generated_dataset(tmp)
        model = MODEL
        if a.tiny:
            from moe_ft.cli.drill import TINY

            model = [*TINY, "--moe-token-dispatcher-type", "alltoall"]
        # (policy, name, window, extra flags, tag suffix)
        variants: list[tuple[str, str, int, list[str], str]] = [] if a.skip_none else [("none", "none", 0, [], "")]
        for w in a.windows:
            if not a.skip_default:
                variants.append(("sparse", f"sparse(W={w or 'auto'})", w, [], ""))
            if a.staged:
                variants.append(("sparse", f"sparse(W={w or 'auto'},staged)", w, ["--no-ft-snapshot-direct-write"],
                                 "s"))
            if a.paced:
                variants.append(("sparse", f"sparse(W={w or 'auto'},paced {a.paced} MiB)", w,
                                 ["--ft-snapshot-copy-piece-mb", str(a.paced)], "p"))
            for k in a.kernel_copy:
                variants.append(("sparse", f"sparse(W={w or 'auto'},kernel copy on {k or 'all'} programs)", w,
                                 ["--ft-snapshot-copy-by", "kernel", "--ft-snapshot-copy-programs", str(k)], f"k{k}"))
                if a.publish_agent:
                    variants.append(("sparse", f"sparse(W={w or 'auto'},kernel copy on {k or 'all'} programs,"
                                     "published by the agent)", w, ["--ft-snapshot-copy-by", "kernel",
                                     "--ft-snapshot-copy-programs", str(k), "--ft-publish-by", "agent"], f"k{k}a"))
            for step in a.steps:
                variants.append(("sparse", f"sparse(W={w or 'auto'},{step} only)" if step == "copy" else
                                 f"sparse(W={w or 'auto'},up to {step})", w, ["--bench-snapshot-step", step], step[0]))
        runs: dict[str, list[dict]] = {name: [] for _, name, _, _, _ in variants}
        for rep in range(a.repeats):
            for policy, name, window, extra, suffix in variants:
                tag = f"{policy}{window or ''}{suffix}_{rep}"
                out = os.path.join(tmp, f"{tag}.json")
                log = os.path.join(a.log_dir or tmp, f"gpu_overhead_{tag}.log")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", __file__,
                       "--worker", "--out", out, *model, "--train-iters", str(a.iters), "--log-interval", str(a.iters),
                       "--data-path", data, "--ft", "--ft-policy", policy, "--ft-store-dir", store,
                       "--ft-job-id", tag, "--ft-sparse-window", str(window),
                       "--ft-snapshot-bandwidth", str(a.snapshot_bandwidth), *extra,
                       *(["--ft-recovery-scope", "global"] if a.interleave else []),
                       "--bench-interleave", str(a.interleave), "--bench-warmup", str(a.warmup),
                       "--bench-profile-submit", str(a.profile_submit if policy == "sparse" else 0),
                       "--bench-profile-worker", str(a.profile_worker if policy == "sparse" else 0),
                       "--bench-switch-interval", str(a.switch_interval), "--bench-gil-probe", str(a.gil_probe),
                       "--bench-trace-blocks", str(a.trace_blocks if policy == "sparse" else 0),
                       "--bench-profile-dir", a.log_dir or tmp]
                env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
                with open(log, "w") as f:
                    rc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
                if rc != 0:
                    with open(log) as f:
                        tail = f.read()[-4000:]
                    print(json.dumps({"error": f"{name} launch failed ({rc})", "log_tail": tail}))
                    return rc
                with open(out) as f:
                    runs[name].append(_summary(json.load(f), a.warmup))
                if a.log_dir:  # each launch's summary as it ends: a run cut short keeps what it measured
                    with open(os.path.join(a.log_dir, f"gpu_overhead_{tag}.json"), "w") as f:
                        json.dump({"variant": name, **runs[name][-1]}, f)
    med = {k: statistics.median(r["median_iter_s"] for r in v) for k, v in runs.items()}
    result = {"model": " ".join(model), "iters": a.iters, "warmup": a.warmup, "runs": runs,
              "snapshot_bandwidth": a.snapshot_bandwidth, "switch_interval_s": a.switch_interval or None}
    if "none" in med:
        result["overhead_ratio"] = {k: v / med["none"] for k, v in med.items() if k != "none"}
    if a.interleave:  # medians over launches, as overhead_ratio
        result["interleave"] = a.interleave
        result["interleaved_ratio"] = {k: statistics.median(r["interleaved"]["ratio"] for r in v)
                                       for k, v in runs.items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        sys.exit(worker(sys.argv[1:]))
    sys.exit(main())
