"""Checkpoint overhead of the snapshot policies on a CPU model, side by side in one run.

    python tools/bench/ckpt_overhead.py [--model {tiny,medium}] [--quick] [--json] [--nproc {2,4}] [--two-copies] [--agent-hash] [--agent-publish] [--xxh3] [--warmup-cycles N] [--data-path PREFIX]
        [--policies a,b] [--cycles N] [--control] [--pin-cores] [--profile-worker N --profile-dir DIR]
        [--iterations-json PATH]

Models: ``tiny`` (2 layers, hidden 64, 4 experts top-2, seq 64; ~50 ms of CPU per iteration: fixed
per-iteration costs dominate) and ``medium`` (4 layers, hidden 256, 8 experts top-2, seq 128; >= 1 s per
iteration on 2 cores: the bytes dominate, as on real models). ``--model medium --json`` takes ~6-8 min on 2 cores.

Launches ``torchrun`` (4 ranks, EP=2 x PP=2, 1 thread each; ``--nproc 2``: EP=2, one stage) on this file. The FT runtime holds one
session (policy + engine + store) per policy — ``none``, ``dense(1)``, ``dense(k)``, ``pec``,
``selective``, ``sparse`` and, with pipeline parallelism, ``sparse(bubbles)`` (bubble-aware copies, MoEtion
Alg. 4) — and hands iterations to them in blocks of ``W`` (the sparse window),
cycling, so every policy sees the same machine noise; the first cycles (``--warmup-cycles``, default 3: until
every store holds what its retention keeps) are warm-up. Reported per policy:

* ``overhead_ratio``: median wall time of its iterations / median of ``none`` (begin of ``t`` to begin of
  ``t+1``: includes the plan, metadata capture, submit and the stall). The first iteration of every block
  counts for no session: it holds the write of the previous block's last snapshot, another session's;
* ``cpu_ratio``: the same with the job's CPU time per iteration (all threads of all ranks, summed over the
  ranks) instead of wall time: what the snapshots cost in CPU, much less sensitive than wall time to other
  load on a shared machine. Summing over the ranks cancels the data noise of a single rank: with
  expert parallelism an iteration's routing decides how many tokens each rank's experts get, but not the
  total (every token goes to ``topk`` experts somewhere); ``cpu_ratio_per_rank`` is the median over ranks
  of each rank's own ratio of medians (the definition before it carries that noise);
  ``main_cpu_ratio``: ``cpu_ratio`` of the training threads alone (what the policy costs the training
  thread itself: hook, capture, and any slowdown the snapshot thread causes it);
  ``cpu_ratio_ci95``: the 95 % bootstrap interval of ``cpu_ratio`` over the measured cycles
  (``tools/bench/ratio_ci.py``; ``null`` with one measured cycle): a claim such as ``cpu_ratio <= 1.02``
  holds when its upper end does;
* ``accounted_ratio``: ``1 +`` the FT work the ranks' threads account for per measured iteration (the snapshot
  thread's CPU, and the hook's CPU beyond the hook of ``none``) / the job CPU of a ``none`` iteration: the
  direct cost, without what the snapshots do to the training threads' speed (caches, memory bandwidth), which
  only ``cpu_ratio`` sees; unlike ``cpu_ratio`` it does not carry the machine's drift of CPU time per
  iteration, so it is what one short run can resolve (docs/benchmarks.md, "What the acceptance command can
  resolve");
* ``--iterations-json PATH``: every measured iteration's job CPU seconds per session (all threads, the
  training threads, system time) and minor page faults, keyed by iteration, for analyses of the noise;
* ``stall_ms``: median wait of the optimizer step for the snapshot copy;
* ``hook_ms``: median time of the FT hook after the optimizer step on the training thread (popularity
  all-reduce, plan, metadata capture, submit; ``none`` pays the all-reduce only); ``hook_cpu_ms``: its CPU;
* ``thread_cpu_ms``: median CPU time of the background snapshot thread per snapshot (copy, encode,
  checksum, write, publish, garbage collection) — CPU the 2 shared cores lose to the training processes;
* ``entries_cpu_ms``: the part of ``thread_cpu_ms`` spent until the operators' entries were written (the
  rest: metadata entry, manifest, publish, garbage collection);
* ``trainer_payload_bytes_per_byte``: payload bytes the trainer process's threads pass over on the host per
  snapshot byte (``SnapshotRecord.trainer_payload_bytes_per_byte``; bytes-weighted over the measured
  snapshots): 1 on the CPU direct path into the arena with moe-ft's C extension (a copy that hashes), 2 with
  xxh3_64 (checksum + store write), 3 through slot buffers;
* ``--xxh3`` adds ``sparse(xxh3_64)``: sparse with ``--ft-store-checksum xxh3_64``, whose entries are hashed and
  then written (two host passes), beside ``sparse``, whose copy into the arena hashes as it goes (``mfh64``
  with moe-ft's C extension: one pass);
* ``--agent-hash`` adds ``sparse(agent hash)``: sparse with ``--ft-checksum-by agent`` (the trainer writes
  each byte once, the node agent hashes the published points); ``agent_cpu_ms_per_iter`` is the node
  agent process's CPU per iteration of a session whose points an agent hashes (an agent of its own, started
  for it; with ``--ft-checksum-by agent`` every session's) — not in ``cpu_ratio``, which counts the ranks;
* ``--agent-publish`` adds ``sparse(agent publish)``: sparse with ``--ft-publish-by agent`` (the trainer copies
  each snapshot into its arena, the node agent seals, publishes and collects it); ``agent_cpu_ms_per_iter`` as
  above, from the CPU the agent answers each publish with;
* ``--control`` adds ``none(control)``: a second session without snapshots; its ratios to ``none`` are 1 in
  truth, so what they and their interval show is the measurement's own noise. ``--pin-cores`` binds each
  training process (all its threads) to one core, so that a rank's snapshot thread competes with its own
  training thread only;
* ``gc_ms_per_iter``, ``gc_full_per_100_iters``: Python's cyclic garbage collections during the session's
  iterations, all ranks (``tools/bench/gc_times.py``: a collection holds the GIL, whichever thread ran it);
* ``--profile-worker N``: the sparse session's snapshot thread, sub-step by sub-step (wall and CPU), on N of
  its last snapshots, per rank in ``--profile-dir`` (``tools/bench/worker_profile.py``);
* ``meta_cpu_ms``: median CPU time of the metadata capture (``capture_step_meta``) on the training thread;
* ``bytes_per_iter``: mean bytes snapshotted per iteration per rank (max over ranks);
* ``floor_ms``: the physical floor of that policy: the time to copy (``memcpy``) and checksum (XXH3)
  ``bytes_per_iter`` at this machine's bandwidths, measured by this run before training (``_setup``:
  ``memcpy_gbps``, ``hash_gbps``; ``copy_hash_gbps``: the copy that hashes, ``mfh64`` in C, for comparison);
  ``floor_ratio`` = 1 + floor / median CPU time of a ``none`` iteration;
* ``bytes_per_recovery_point``: bytes one recovery point keeps per rank (max over ranks): dense one
  snapshot; sparse the ``W`` snapshots of a window (MoEvement §3.3); pec/selective each operator's newest
  FULL (MoC/MoEtion lossy recovery), i.e. all FULL bytes.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WINDOW = 5
DENSE_K = 5
POLICIES = ["none", "dense(1)", "dense(k)", "pec", "selective", "sparse"]
BUBBLES = "sparse(bubbles)"  # sparse with bubble-aware copies (MoEtion Alg. 4): pipeline parallelism only
TWO_COPIES = "sparse(2 copies)"  # --two-copies: sparse through slot buffers into new files (the path before)
AGENT_HASH = "sparse(agent hash)"  # --agent-hash: sparse with the node agent hashing the published points
AGENT_PUBLISH = "sparse(agent publish)"  # --agent-publish: sparse with the node agent sealing and publishing
XXH3 = "sparse(xxh3_64)"  # --xxh3: sparse hashed with xxh3_64 and then written (two host passes)
CONTROL = "none(control)"  # --control: a second session without snapshots, the method's own noise


def labels(pp: int, two_copies: bool = False, agent_hash: bool = False, only: str = "",
           control: bool = False, xxh3: bool = False, agent_publish: bool = False) -> list[str]:
    """The sessions compared, in cycling order; ``only`` (``--policies``, comma-separated): just these of
    :data:`POLICIES`, in the order given (``none`` always, first: the baseline)."""
    chosen = POLICIES if not only else ["none"] + [p for p in dict.fromkeys(only.split(",")) if p in POLICIES[1:]]
    return (chosen + ([BUBBLES] if pp > 1 and (not only or BUBBLES in only.split(",")) else [])
            + ([TWO_COPIES] if two_copies else []) + ([AGENT_HASH] if agent_hash else [])
            + ([AGENT_PUBLISH] if agent_publish else []) + ([XXH3] if xxh3 else []) + ([CONTROL] if control else []))
MODELS = {  # flags, measured cycles (default, --quick)
    "tiny": (["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
              "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
              "--micro-batch-size", "2", "--global-batch-size", "8"], 10, 3),
    "medium": (["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
                "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                "--micro-batch-size", "4", "--global-batch-size", "32"], 3, 1),
}
PP = {4: 2, 2: 1}  # ranks -> pipeline stages (EP = 2 always): 4 ranks = EP2 x PP2, 2 ranks = EP2


def worker(argv: list[str]) -> int:
    if "--pin-cores" in argv:  # before any other thread exists (imports included): later threads inherit the set
        argv.remove("--pin-cores")
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})
    import dataclasses


    sys.path.insert(0, ROOT)
    import moe_ft.runtime.hooks as hooks_module
    import moe_ft.snapshot.meta as meta_module
    import pretrain_gpt_moe
    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain
    from moe_ft.agent.verify import AgentChecksums
    from moe_ft.runtime.hooks import FTRuntime
    from moe_ft.state.operators import Level
    from tools.bench.gc_times import GcTimes

    out = argv.pop(argv.index("--out") + 1)
    argv.remove("--out")
    cycle = argv.pop(argv.index("--sessions") + 1).split(",")  # the sessions in cycling order (labels())
    argv.remove("--sessions")
    warmup = int(argv.pop(argv.index("--warmup-cycles") + 1))
    argv.remove("--warmup-cycles")
    profile_n = int(argv.pop(argv.index("--profile-worker") + 1))
    argv.remove("--profile-worker")
    profile_dir = argv.pop(argv.index("--profile-dir") + 1)
    argv.remove("--profile-dir")
    meta_cpu: list[float] = []
    capture = meta_module.capture_step_meta

    def timed_capture(**kwargs):  # what the runtime calls: its module's name is replaced below
        cpu = time.thread_time()
        try:
            return capture(**kwargs)
        finally:
            meta_cpu.append(time.thread_time() - cpu)

    meta_module.capture_step_meta = timed_capture
    hooks_module.capture_step_meta = timed_capture  # the runtime imported the name (it was read as 0 ms before)
    collections = GcTimes().install()
    args = parse_args(argv, extra_groups=pretrain_gpt_moe.extra_argument_groups())
    base = args.extra["FTConfig"]
    block = WINDOW
    pp = args.parallel.pipeline_model_parallel_size

    def session_at(t: int) -> str:
        return cycle[(t // block) % len(cycle)]

    class Bench(FTRuntime):
        def build(self, t_iter_s):
            super().build(t_iter_s)  # registry, catalogue, the configured (sparse) session
            from moe_ft.state.catalogue import copied_bytes

            # bytes a rank copies when every non-expert is FULL (each EP rank copies its stage's non-experts)
            non_expert = max(copied_bytes({i.op: Level.FULL for i in self.catalogue if not i.op.is_expert},
                                          self.catalogue).values())
            expert = max(i.bytes_full for i in self.catalogue if i.op.is_expert)
            variants = {
                "none": dict(policy="none"),
                "dense(1)": dict(policy="dense", dense_interval=1),
                "dense(k)": dict(policy="dense", dense_interval=DENSE_K),
                "pec": dict(policy="pec", pec_k=1),
                "selective": dict(policy="selective", selective_local_budget=non_expert + 2 * expert),
                "sparse": dict(policy="sparse", sparse_window=WINDOW),
            }
            if pp > 1:
                variants[BUBBLES] = dict(policy="sparse", sparse_window=WINDOW, snapshot_bubble_aware=True)
            variants[TWO_COPIES] = dict(policy="sparse", sparse_window=WINDOW, snapshot_direct_write=False,
                                        store_recycle=False, store_layout="files")
            variants[AGENT_HASH] = dict(policy="sparse", sparse_window=WINDOW, checksum_by="agent")
            variants[AGENT_PUBLISH] = dict(policy="sparse", sparse_window=WINDOW, publish_by="agent")
            variants[XXH3] = dict(policy="sparse", sparse_window=WINDOW, store_checksum="xxh3_64")
            variants[CONTROL] = dict(policy="none")
            for s in self.sessions:
                s.close()
            self.by_label = {name: self.build_session(dataclasses.replace(base.snapshot, **kw), job_suffix=f"-{i}")
                             for i, (name, kw) in enumerate(variants.items()) if name in cycle}
            for name, s in self.by_label.items():
                if s is not None:
                    s.name = name
            self.sessions = [s for s in self.by_label.values() if s is not None]
            for c in [c for c in self.components if isinstance(c, AgentChecksums)]:
                c.close()  # the configured session's agent hashed a store this bench closed: its ranks say bye
                self.components.remove(c)
            self.agents: dict[str, AgentChecksums] = {}
            self.agent_cpu: dict[str, list[tuple[int, float]]] = {}  # (iteration, the agent's CPU s) per publish
            for name, s in self.by_label.items():
                if s is not None and s.store.defer_checksums:  # --ft-checksum-by agent: an agent per session
                    agent = AgentChecksums(s.store, rank=self.rank,
                                           agent_dir=os.path.join(s.store_root, s.job_id, "agent"))
                    self.agents[name] = agent
                    self.components.append(agent)
                    cpu = self.agent_cpu[name] = []
                    agent.agent_cpu.take = lambda it, s_, cpu=cpu: cpu.append((it, s_))
                elif s is not None and s.publisher is not None:  # --ft-publish-by agent: its answers carry its CPU
                    cpu = self.agent_cpu[name] = []
                    s.publisher.agent_cpu.take = lambda it, s_, cpu=cpu: cpu.append((it, s_))
            if profile_n:  # the sparse session's last snapshots but one (the last is flushed at the end)
                from tools.bench.worker_profile import WorkerProfiler

                its = [t for t in range(args.training.train_iters) if session_at(t) == "sparse"]
                WorkerProfiler(its[-profile_n - 1:-1], profile_dir, f"sparse_rank{self.rank}").attach(
                    self.by_label["sparse"].engine)
            if BUBBLES in self.by_label:
                from moe_ft.snapshot.bubble_component import BubbleScheduling

                self.components.append(BubbleScheduling.build(self.by_label[BUBBLES], pipeline_size=pp,
                                                              rank=self.rank))
            self.owner: dict[int, str] = {}
            # each session's own record of its FULL snapshots (popularity's since_full and last_full_iteration,
            # and the cumulative hard counts when it was put aside): one shared record would let a session's
            # policy take another's FULL snapshots, which its store does not hold, for its own
            self.full_books: dict[str, tuple] = {}
            self.hook_seconds: dict[int, float] = {}
            self.hook_cpu: dict[int, float] = {}
            self.meta_cpu: dict[int, float] = {}

        def __init__(self, config):
            super().__init__(config)
            self.iteration_cpu: dict[int, float] = {}
            self.iteration_main_cpu: dict[int, float] = {}
            self._cpu_start = self._main_start = None
            self.iteration_usage: dict[int, tuple[float, int]] = {}  # (system CPU s, minor page faults)
            self._usage_start: tuple[float, int] | None = None

        def on_step_begin(self, iteration):
            now = time.process_time()  # CPU of every thread of this rank: robust to other load on the box
            main = time.thread_time()  # the training thread alone
            if self._cpu_start is not None:
                self.iteration_cpu[iteration - 1] = now - self._cpu_start
                self.iteration_main_cpu[iteration - 1] = main - self._main_start
            self._cpu_start, self._main_start = now, main
            usage = resource.getrusage(resource.RUSAGE_SELF)
            if self._usage_start is not None:
                self.iteration_usage[iteration - 1] = (usage.ru_stime - self._usage_start[0],
                                                       usage.ru_minflt - self._usage_start[1])
            self._usage_start = (usage.ru_stime, usage.ru_minflt)
            collections.iteration = iteration
            super().on_step_begin(iteration)

        def on_step_end(self, iteration, result):
            start, cpu, captures = time.perf_counter(), time.thread_time(), len(meta_cpu)
            super().on_step_end(iteration, result)
            self.hook_seconds[iteration] = time.perf_counter() - start
            self.hook_cpu[iteration] = time.thread_time() - cpu
            if len(meta_cpu) > captures:
                self.meta_cpu[iteration] = meta_cpu[-1]

        def select_session(self, iteration):
            label = session_at(iteration)
            before = self.owner.get(iteration - 1)
            if before in self.agents and before != label:
                # The node agent hashes a point after it is published, in its own process: the last points of
                # an agent-hashed block would be hashed during the next session's iterations (measured: a
                # session without snapshots after one read ~1 % more CPU than `none`). Wait for the publish
                # and the hashing here, in a block-first iteration, which counts for no session.
                self.by_label[before].engine.flush()
                self.agents[before].client.flush()
            if before is not None and before != label:
                self._swap_full_books(before, label)
            self.owner[iteration] = label
            return self.by_label[label]

        def _swap_full_books(self, before: str, label: str) -> None:
            """Put ``before``'s FULL record aside and take up ``label``'s: tokens routed since it was put aside
            count as tokens since its FULL snapshots; a session not seen yet starts as a job without any."""
            import torch  # in the worker only: the launching process of this file does not import torch

            pop = self.popularity
            self.full_books[before] = (pop.since_full.clone(), pop.last_full_iteration.clone(), pop.hard.clone())
            since, last, hard = self.full_books.get(
                label, (torch.zeros_like(pop.since_full), torch.full_like(pop.last_full_iteration, -1),
                        torch.zeros_like(pop.hard)))
            pop.since_full = since + (pop.hard - hard)
            pop.last_full_iteration = last

        def on_train_end(self, report):
            super().on_train_end(report)  # flushes the engines
            self.gc = collections
            summarize(self, out, cycle, warmup)  # collectives: before the group is shut down

    from moe_ft.compat import activate_all

    activate_all()  # CPU layer + checkpoint-writer shim, as pretrain_gpt_moe.py does
    pretrain(args, hooks=Bench(base))
    return 0


def summarize(runtime, out: str, names: list[str], warmup: int = 1) -> None:
    import torch.distributed as dist

    from moe_ft.policy import SparsePolicy
    from moe_ft.state.operators import Level
    from tools.bench.ratio_ci import cycle_ratio_ci

    block = WINDOW
    first_measured = warmup * block * len(names)  # the first cycles are warm-up
    reg = runtime.registry
    local: dict = {}
    for label, s in runtime.by_label.items():
        # A block's first iteration counts for no session: its interval holds the write of the previous
        # block's last snapshot (another session's; the write of t runs during t+1's forward pass) and none
        # of this session's (tools/bench/interleave.py, the same rule).
        its = [t for t, n in runtime.owner.items() if n == label and t >= first_measured and t % block]
        measured = set(its)
        times = [runtime.iteration_seconds[t] for t in its if t in runtime.iteration_seconds]
        recs = [r for r in (s.engine.records if s is not None else []) if r.iteration >= first_measured]
        full = sum(reg[op].nbytes(Level.FULL) for op in reg)
        if s is None:  # no snapshots
            rp = 0
        elif isinstance(s.policy, SparsePolicy):  # a recovery point is a window of sparse snapshots
            win = s.policy.window_of(max(r.iteration for r in recs))
            rp = sum(reg.nbytes(win.plan(t)) for t in range(win.start, win.end))
        else:
            rp = full
        hook = [runtime.hook_seconds[t] for t in its if t in runtime.hook_seconds]
        cpu = [runtime.iteration_cpu[t] for t in its if t in runtime.iteration_cpu]
        meta = [runtime.meta_cpu[t] for t in its if t in runtime.meta_cpu]
        local[label] = {"median_s": statistics.median(times),
                         "meta_cpu_ms": 1e3 * statistics.median(meta) if meta else 0.0,
                         "median_cpu_s": statistics.median(cpu),
                         "cpu_by_iter": {t: runtime.iteration_cpu[t] for t in its if t in runtime.iteration_cpu},
                         "main_cpu_by_iter": {t: runtime.iteration_main_cpu[t] for t in its
                                              if t in runtime.iteration_main_cpu},
                         "usage_by_iter": {t: runtime.iteration_usage[t] for t in its if t in runtime.iteration_usage},
                         "hook_cpu_ms": 1e3 * statistics.median(runtime.hook_cpu[t] for t in its if t in runtime.hook_cpu),
                         "hook_ms": 1e3 * statistics.median(hook) if hook else 0.0,
                         "thread_cpu_ms": 1e3 * statistics.median([getattr(r, "thread_cpu_s", 0.0) for r in recs])
                         if recs else 0.0,
                         "stall_ms": 1e3 * statistics.median([r.stall_s for r in recs]) if recs else 0.0,
                         "entries_cpu_ms": 1e3 * statistics.median([r.entries_cpu_s for r in recs]) if recs else 0.0,
                         "bytes_per_iter": sum(r.bytes for r in recs) / max(len(its), 1),
                         "touched": sum(r.host_bytes_touched for r in recs),
                         "payload": sum(r.bytes + r.remote_bytes for r in recs),
                         "bytes_per_recovery_point": rp,
                         "pool": _pool_stats(s),
                         "arena_bytes": getattr(s.store.backend, "arena_bytes", 0) if s is not None else 0,
                         "points_kept": len(s.store.backend.list_points()) if s is not None else 0,
                         "gc": runtime.gc.totals(its), "iterations": len(its),
                         # the FT work this rank's threads account for, per measured iteration: the snapshot
                         # thread's CPU and the hook's (the hook of 'none' is subtracted below)
                         "thread_cpu_per_iter_s": sum(getattr(r, "thread_cpu_s", 0.0) for r in recs
                                                      if r.iteration in measured) / max(len(its), 1),
                         "hook_cpu_per_iter_s": sum(runtime.hook_cpu[t] for t in its if t in runtime.hook_cpu)
                         / max(len(its), 1)}
        if label in runtime.agents:  # the node agent's CPU over the measured cycles (it hashes this session's points)
            state = runtime.agents[label].final  # closed with the runtime (it said bye: the agent may be gone)
            start = next((cpu for it, cpu in runtime.agent_cpu[label] if it >= first_measured), state["cpu_s"])
            # every snapshot of the session from the first measured one on, block-first iterations included
            snapshots = sum(1 for t, n in runtime.owner.items() if n == label and t >= first_measured)
            local[label]["agent_cpu_ms_per_iter"] = 1e3 * (state["cpu_s"] - start) / max(snapshots - 1, 1)
            local[label]["agent_verified"] = state["verified"]
        elif label in runtime.agent_cpu:  # the agent that publishes this session's points: CPU between its answers
            samples = [cpu for it, cpu in runtime.agent_cpu[label] if it >= first_measured]
            if len(samples) > 1:
                local[label]["agent_cpu_ms_per_iter"] = 1e3 * (samples[-1] - samples[0]) / (len(samples) - 1)
                local[label]["agent_published"] = len(runtime.agent_cpu[label])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if dist.get_rank() == 0:
        def job_cpu_by_cycle(name: str, key: str = "cpu_by_iter") -> dict[int, list[float]]:
            """The CPU seconds of all ranks together per iteration of the policy, grouped by cycle."""
            its = set.intersection(*(set(g[name][key]) for g in gathered))
            cycles: dict[int, list[float]] = {}
            for t in sorted(its):
                cycles.setdefault(t // (block * len(names)), []).append(sum(g[name][key][t] for g in gathered))
            return cycles

        def job_cpu(name: str, key: str = "cpu_by_iter") -> float:
            """Median over the policy's iterations of the CPU seconds of all ranks together."""
            return statistics.median(x for v in job_cpu_by_cycle(name, key).values() for x in v)

        base_t = statistics.median([g["none"]["median_s"] for g in gathered])
        base_cpu = statistics.median([g["none"]["median_cpu_s"] for g in gathered])
        base_job, base_main = job_cpu("none"), job_cpu("none", "main_cpu_by_iter")
        base_cycles = job_cpu_by_cycle("none")
        cycles = len(base_cycles)
        report = {}
        for name in names:
            med = statistics.median([g[name]["median_s"] for g in gathered])
            cpu = statistics.median([g[name]["median_cpu_s"] for g in gathered])
            report[name] = {"overhead_ratio": round(med / base_t, 4),
                            "cpu_ratio": round(job_cpu(name) / base_job, 4),
                            "cpu_ratio_ci95": [round(x, 4) for x in cycle_ratio_ci(job_cpu_by_cycle(name), base_cycles)]
                            if name != "none" and cycles > 1 else None,
                            "cpu_ratio_per_rank": round(cpu / base_cpu, 4),
                            "main_cpu_ratio": round(job_cpu(name, "main_cpu_by_iter") / base_main, 4),
                            "hook_cpu_ms": round(statistics.median(g[name]["hook_cpu_ms"] for g in gathered), 3),
                            "stall_ms": round(max(g[name]["stall_ms"] for g in gathered), 4),
                            "hook_ms": round(statistics.median(g[name]["hook_ms"] for g in gathered), 3),
                            "meta_cpu_ms": round(statistics.median(g[name]["meta_cpu_ms"] for g in gathered), 3),
                            "thread_cpu_ms": round(statistics.median(g[name]["thread_cpu_ms"] for g in gathered), 3),
                            "entries_cpu_ms": round(statistics.median(g[name]["entries_cpu_ms"] for g in gathered), 3),
                            "bytes_per_iter": int(max(g[name]["bytes_per_iter"] for g in gathered)),
                            "trainer_payload_bytes_per_byte": round(sum(g[name]["touched"] for g in gathered)
                                                                    / max(sum(g[name]["payload"] for g in gathered), 1), 3),
                            "bytes_per_recovery_point": int(max(g[name]["bytes_per_recovery_point"] for g in gathered)),
                            "recycled_files": gathered[0][name]["pool"],
                            "arena_mb": round(max(g[name]["arena_bytes"] for g in gathered) / 1e6, 1),
                            "points_kept": max(g[name]["points_kept"] for g in gathered),
                            "gc_ms_per_iter": round(1e3 * sum(g[name]["gc"][0] for g in gathered)
                                                    / max(sum(g[name]["iterations"] for g in gathered), 1), 3),
                            "gc_full_per_100_iters": round(100 * sum(g[name]["gc"][1] for g in gathered)
                                                           / max(sum(g[name]["iterations"] for g in gathered), 1), 2),
                            "accounted_ratio": round(1 + sum(g[name]["thread_cpu_per_iter_s"] + g[name]["hook_cpu_per_iter_s"]
                                                             - g["none"]["hook_cpu_per_iter_s"] for g in gathered)
                                                     / base_job, 4)}
            if "agent_cpu_ms_per_iter" in gathered[0][name]:  # one agent per node, shared by its ranks: its CPU once
                report[name]["agent_cpu_ms_per_iter"] = round(max(g[name]["agent_cpu_ms_per_iter"] for g in gathered), 3)
                for key in ("agent_verified", "agent_published"):  # the points it hashed, or published
                    if key in gathered[0][name]:
                        report[name][f"{key}_points"] = sum(g[name][key] for g in gathered)
        def job_per_iteration(name: str, key: str, part: int | None = None) -> dict[int, float]:
            """Per measured iteration of every rank: the sum over the ranks of ``key`` (of its ``part``)."""
            its = set.intersection(*(set(g[name][key]) for g in gathered))
            return {t: sum(g[name][key][t] if part is None else g[name][key][t][part] for g in gathered) for t in its}

        report["_iterations"] = {name: {"cpu": job_per_iteration(name, "cpu_by_iter"),
                                        "main_cpu": job_per_iteration(name, "main_cpu_by_iter"),
                                        "sys_cpu": job_per_iteration(name, "usage_by_iter", 0),
                                        "minor_faults": job_per_iteration(name, "usage_by_iter", 1)}
                                 for name in names}
        report["_setup"] = {"window": WINDOW, "warmup_cycles": warmup, "dense_k": DENSE_K,
                            "iterations": runtime.args.training.train_iters,
                            "ranks": dist.get_world_size(),
                            "median_iter_s_none": round(base_t, 4), "median_iter_cpu_s_none": round(base_cpu, 4),
                            "median_job_cpu_s_none": round(base_job, 4)}
        with open(out, "w") as f:
            json.dump(report, f)


def _pool_stats(session) -> dict | None:
    """Rank's recycled-file pool of a session: entries written over pooled files of all entries written."""
    pool = getattr(session.store.backend, "pool", None) if session is not None else None
    if pool is None:
        return None
    entries = sum(r.num_full + r.num_compute + 1 for r in session.engine.records if r.published)
    return {"reused": pool.reused, "entries": entries, "pool_mb": round(pool.bytes / 1e6, 1), "limit_mb": round(pool.limit / 1e6, 1)}


def measure_bandwidth(nbytes: int = 128 << 20, repeats: int = 5) -> dict:
    """Bytes/s of a host ``memcpy`` (``torch`` copy, one thread) and of the store's checksum on a buffer
    larger than the caches (state-sized), best of ``repeats``: the physical floor's two terms."""
    import torch

    from moe_ft.store.codec import DEFAULT_CHECKSUM, new_checksum, raw_bytes

    torch.set_num_threads(1)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    view = raw_bytes(src)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return nbytes / min(times)

    def digest() -> None:
        h = new_checksum(DEFAULT_CHECKSUM)
        for start in range(0, nbytes, 8 << 20):  # beyond the caches: a pass over memory
            h.update(view[start:start + (8 << 20)])
        h.digest()

    from moe_ft.store import entry_hash

    out = {"memcpy": best(lambda: dst.copy_(src)), "hash": best(digest), "hash_algo": DEFAULT_CHECKSUM}
    if entry_hash.NATIVE:  # the CPU snapshot path's copy into the arena, which hashes (mfh64) as it copies
        out["copy_hash"] = best(lambda: entry_hash.copy_lane_sums(src, dst, 0))
    return out


def add_floor(report: dict, bandwidth: dict) -> None:
    """``floor_ms`` per policy: copy + checksum its bytes per iteration at the measured bandwidths, and
    ``floor_ratio``: the CPU ratio a policy would have if it cost exactly that."""
    base_cpu_s = report["_setup"]["median_iter_cpu_s_none"]
    for name in [n for n in report if not n.startswith("_")]:
        nbytes = report[name]["bytes_per_iter"]
        floor_s = nbytes / bandwidth["memcpy"] + nbytes / bandwidth["hash"]
        report[name]["floor_ms"] = round(1e3 * floor_s, 3)
        report[name]["floor_ratio"] = round(1 + floor_s / base_cpu_s, 4) if base_cpu_s > 0 else None


def main() -> int:
    import argparse

    sys.path.insert(0, ROOT)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS),
                   help="tiny (fixed costs dominate) or medium (>= 1 s/iteration on 2 cores; bytes dominate)")
    p.add_argument("--quick", action="store_true",
                   help="fewer measured cycles (tiny: 3 instead of 10, < 3 min; medium: 1 instead of 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by policy (and _setup)")
    p.add_argument("--data-path", default=None, help="indexed dataset prefix (default: a generated corpus)")
    p.add_argument("--warmup-cycles", type=int, default=3,
                   help="cycles left out of the measurement (default 3: steady state). A store grows until its "
                        "retention first deletes points and reuses their space: sparse keeps two complete "
                        "windows, so with blocks of one window per cycle its arena grows (new tmpfs pages, "
                        "zero-filled at first touch: a one-time cost per job) until the fourth cycle; 1 "
                        "measures that growth too")
    p.add_argument("--two-copies", action="store_true",
                   help=f"add the session {TWO_COPIES!r}: sparse through slot buffers into new files (the data path "
                        "before direct writes and recycled files), side by side with 'sparse'")
    p.add_argument("--agent-hash", action="store_true",
                   help=f"add the session {AGENT_HASH!r}: sparse with --ft-checksum-by agent (the node agent hashes "
                        "the published points), side by side with 'sparse'")
    p.add_argument("--agent-publish", action="store_true",
                   help=f"add the session {AGENT_PUBLISH!r}: sparse with --ft-publish-by agent (the trainer copies, the "
                        "node agent seals, publishes and collects), side by side with 'sparse'")
    p.add_argument("--xxh3", action="store_true",
                   help=f"add the session {XXH3!r}: sparse with --ft-store-checksum xxh3_64 (each entry hashed, then "
                        "written: two host passes; the CPU default before the copy that hashes), side by side "
                        "with 'sparse'")
    p.add_argument("--control", action="store_true",
                   help=f"add the session {CONTROL!r}: a second session without snapshots, whose ratio to 'none' "
                        "(1 in truth) shows the measurement's own noise")
    p.add_argument("--pin-cores", action="store_true",
                   help="bind each training process, and every thread it starts, to one core (local rank i to "
                        "the i-th core this process may use, cycling): a rank's snapshot thread then shares its "
                        "own rank's core, not the others'")
    p.add_argument("--policies", default="",
                   help=f"comma-separated sessions to compare, of {', '.join(POLICIES[1:] + [BUBBLES])}, in the "
                        "cycling order given ('none' is always one, first: the baseline); default all. Fewer "
                        "sessions give each more cycles in the same time")
    p.add_argument("--profile-worker", type=int, default=0, metavar="N",
                   help="profile the sparse session's snapshot thread on N of its last snapshots "
                        "(tools/bench/worker_profile.py), each rank's into --profile-dir; wrapped calls cost a "
                        "few microseconds each, in the measured iterations")
    p.add_argument("--profile-dir", default="ckpt_overhead_profile",
                   help="where --profile-worker writes worker_profile_sparse_rank<r>.txt and its JSON")
    p.add_argument("--iterations-json", default=None, metavar="PATH",
                   help="write every measured iteration's job CPU seconds (all ranks; 'cpu': every thread, "
                        "'main_cpu': the training threads, 'sys_cpu': system time) and 'minor_faults' per session "
                        "to PATH, keyed by iteration")
    p.add_argument("--cycles", type=int, default=0,
                   help="measured cycles (default: the model's, or --quick's)")
    p.add_argument("--nproc", type=int, default=4, choices=sorted(PP),
                   help="training processes: 4 (EP=2 x PP=2, default) or 2 (EP=2, one stage: one process per core)")
    a = p.parse_args()
    flags, cycles_default, cycles_quick = MODELS[a.model]
    started, load_before = time.perf_counter(), os.getloadavg()
    bandwidth = measure_bandwidth()
    with tempfile.TemporaryDirectory(prefix="ckpt_overhead_") as tmp, \
            tempfile.TemporaryDirectory(prefix="moe_ft_bench_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        data = a.data_path
        if data is None:
            from tools.preprocess_data import generated_dataset  # start-up time: only without --data-path

            data = generated_dataset(tmp, num_docs=300)
        if a.warmup_cycles < 1:
            p.error("--warmup-cycles must be >= 1")
        cycles = a.warmup_cycles + (a.cycles or (cycles_quick if a.quick else cycles_default))
        names = labels(PP[a.nproc], a.two_copies, a.agent_hash, a.policies, a.control, a.xxh3, a.agent_publish)
        if a.profile_worker and "sparse" not in names:
            p.error("--profile-worker profiles the 'sparse' session: add it to --policies")
        iters = cycles * WINDOW * len(names)
        out = os.path.join(tmp, "report.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}", __file__,
               "--worker", "--out", out, *flags, "--pipeline-model-parallel-size", str(PP[a.nproc]),
               "--train-iters", str(iters), "--log-interval", str(iters),
               "--data-path", data, "--ft", "--ft-store-dir", shm, "--ft-sparse-window", str(WINDOW),
               "--warmup-cycles", str(a.warmup_cycles), "--sessions", ",".join(names),
               "--profile-worker", str(a.profile_worker), "--profile-dir", os.path.abspath(a.profile_dir),
               *(["--pin-cores"] if a.pin_cores else [])]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            return proc.returncode
        report = json.load(open(out))
    iterations = report.pop("_iterations")
    if a.iterations_json:
        with open(a.iterations_json, "w") as f:
            json.dump(iterations, f)
    add_floor(report, bandwidth)
    report["_setup"].update(model=a.model, nproc=a.nproc, memcpy_gbps=round(bandwidth["memcpy"] / 1e9, 2),
                            hash_gbps=round(bandwidth["hash"] / 1e9, 2), hash_algo=bandwidth["hash_algo"],
                            copy_hash_gbps=round(bandwidth["copy_hash"] / 1e9, 2) if "copy_hash" in bandwidth else None,
                            loadavg_before=[round(x, 2) for x in load_before],
                            loadavg_after=[round(x, 2) for x in os.getloadavg()],
                            seconds=round(time.perf_counter() - started, 1))
    if a.json:
        print(json.dumps(report))
    else:
        print(f"{'policy':17s} {'overhead':>9s} {'cpu ratio':>9s} {'95 % interval':>15s} {'accounted':>9s} {'floor ratio':>11s} {'stall ms':>9s} {'hook ms':>8s} "
              f"{'hook cpu':>8s} {'meta cpu':>8s} {'thread ms':>10s} {'floor ms':>9s} {'bytes/iter':>12s} "
              f"{'bytes/recovery pt':>18s}")
        for name in names:
            r = report[name]
            ci = "{:.3f}-{:.3f}".format(*r["cpu_ratio_ci95"]) if r["cpu_ratio_ci95"] else "-"
            print(f"{name:17s} {r['overhead_ratio']:9.3f} {r['cpu_ratio']:9.3f} {ci:>15s} {r['accounted_ratio']:9.4f} "
                  f"{r['floor_ratio']:11.4f} "
                  f"{r['stall_ms']:9.3f} {r['hook_ms']:8.2f} {r['hook_cpu_ms']:8.2f} {r['meta_cpu_ms']:8.2f} "
                  f"{r['thread_cpu_ms']:10.2f} {r['floor_ms']:9.3f} {r['bytes_per_iter']:12d} "
                  f"{r['bytes_per_recovery_point']:18d}")
        print(json.dumps(report["_setup"]))
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        sys.exit(worker(sys.argv[1:]))
    sys.exit(main())
