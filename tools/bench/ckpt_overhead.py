"""Checkpoint overhead of the snapshot policies on the tiny CPU model (issue 3), side by side in one run.

    python tools/bench/ckpt_overhead.py [--quick] [--json] [--nproc {2,4}] [--data-path PREFIX]

Launches ``torchrun`` (4 ranks, EP=2 x PP=2, 1 thread each; ``--nproc 2``: EP=2, one stage) on this file. The FT runtime holds one
session (policy + engine + store) per policy — ``none``, ``dense(1)``, ``dense(k)``, ``pec``,
``selective``, ``sparse`` — and hands iterations to them in blocks of ``W`` (the sparse window),
cycling, so every policy sees the same machine noise; the first cycle is warm-up. Reported per policy:

* ``overhead_ratio``: median wall time of its iterations / median of ``none`` (begin of ``t`` to begin of
  ``t+1``: includes the plan, metadata capture, submit and the stall);
* ``cpu_ratio``: the same with CPU time (all threads of the rank) instead of wall time: what the snapshots
  cost in CPU, much less sensitive than wall time to other load on a shared machine;
* ``stall_ms``: median wait of the optimizer step for the snapshot copy;
* ``hook_ms``: median time of the FT hook after the optimizer step on the training thread (popularity
  all-reduce, plan, metadata capture, submit; ``none`` pays the all-reduce only); ``hook_cpu_ms``: its CPU;
* ``thread_cpu_ms``: median CPU time of the background snapshot thread per snapshot (copy, encode,
  checksum, write, publish, garbage collection) — CPU the 2 shared cores lose to the training processes;
* ``bytes_per_iter``: mean bytes snapshotted per iteration per rank (max over ranks);
* ``bytes_per_recovery_point``: bytes one recovery point keeps per rank (max over ranks): dense one
  snapshot; sparse the ``W`` snapshots of a window (MoEvement §3.3); pec/selective each operator's newest
  FULL (MoC/MoEtion lossy recovery), i.e. all FULL bytes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WINDOW = 5
DENSE_K = 5
POLICIES = ["none", "dense(1)", f"dense(k)", "pec", "selective", "sparse"]
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
         "--micro-batch-size", "2", "--global-batch-size", "8"]
PP = {4: 2, 2: 1}  # ranks -> pipeline stages (EP = 2 always): 4 ranks = EP2 x PP2, 2 ranks = EP2


def worker(argv: list[str]) -> int:
    import dataclasses

    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    import pretrain_gpt_moe
    from megatron.training.arguments import parse_args
    from megatron.training.pretrain import pretrain
    from moe_ft.runtime import FTRuntime
    from moe_ft.state.operators import Level

    out = argv.pop(argv.index("--out") + 1)
    argv.remove("--out")
    args = parse_args(argv, extra_groups=pretrain_gpt_moe.extra_argument_groups())
    base = args.extra["FTConfig"]
    block = WINDOW

    class Bench(FTRuntime):
        def build(self, t_iter_s):
            super().build(t_iter_s)  # registry, catalogue, the configured (sparse) session
            non_expert = max(sum(i.bytes_full for i in self.catalogue if not i.op.is_expert and
                                 (i.pp_rank, i.ep_rank) == key) for key in {(i.pp_rank, i.ep_rank) for i in self.catalogue})
            expert = max(i.bytes_full for i in self.catalogue if i.op.is_expert)
            variants = {
                "none": dict(policy="none"),
                "dense(1)": dict(policy="dense", dense_interval=1),
                "dense(k)": dict(policy="dense", dense_interval=DENSE_K),
                "pec": dict(policy="pec", pec_k=1),
                "selective": dict(policy="selective", selective_local_budget=non_expert + 2 * expert),
                "sparse": dict(policy="sparse", sparse_window=WINDOW),
            }
            for s in self.sessions:
                s.close()
            self.by_label = {name: self.build_session(dataclasses.replace(base.snapshot, **kw), job_suffix=f"-{i}")
                             for i, (name, kw) in enumerate(variants.items())}
            for name, s in self.by_label.items():
                if s is not None:
                    s.name = name
            self.sessions = [s for s in self.by_label.values() if s is not None]
            self.owner: dict[int, str] = {}
            self.hook_seconds: dict[int, float] = {}
            self.hook_cpu: dict[int, float] = {}

        def __init__(self, config):
            super().__init__(config)
            self.iteration_cpu: dict[int, float] = {}
            self._cpu_start = None

        def on_step_begin(self, iteration):
            now = time.process_time()  # CPU of every thread of this rank: robust to other load on the box
            if self._cpu_start is not None:
                self.iteration_cpu[iteration - 1] = now - self._cpu_start
            self._cpu_start = now
            super().on_step_begin(iteration)

        def on_step_end(self, iteration, result):
            start, cpu = time.perf_counter(), time.thread_time()
            super().on_step_end(iteration, result)
            self.hook_seconds[iteration] = time.perf_counter() - start
            self.hook_cpu[iteration] = time.thread_time() - cpu

        def select_session(self, iteration):
            label = POLICIES[(iteration // block) % len(POLICIES)]
            self.owner[iteration] = label
            return self.by_label[label]

        def on_train_end(self, report):
            super().on_train_end(report)  # flushes the engines
            summarize(self, args, out)  # collectives: before pretrain() shuts the process group down

    from moe_ft.compat import activate_all

    activate_all()  # CPU layer + checkpoint-writer shim, as pretrain_gpt_moe.py does
    pretrain(args, hooks=Bench(base))
    return 0


def summarize(runtime, args, out: str) -> None:
    import torch.distributed as dist

    from moe_ft.policy import SparsePolicy
    from moe_ft.state.operators import Level

    block = WINDOW
    first_measured = block * len(POLICIES)  # the first cycle is warm-up
    reg = runtime.registry
    local: dict = {}
    for label, s in runtime.by_label.items():
        its = [t for t, n in runtime.owner.items() if n == label and t >= first_measured]
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
        local[label] = {"median_s": statistics.median(times),
                         "median_cpu_s": statistics.median(cpu),
                         "hook_cpu_ms": 1e3 * statistics.median(runtime.hook_cpu[t] for t in its if t in runtime.hook_cpu),
                         "hook_ms": 1e3 * statistics.median(hook) if hook else 0.0,
                         "thread_cpu_ms": 1e3 * statistics.median([getattr(r, "thread_cpu_s", 0.0) for r in recs])
                         if recs else 0.0,
                         "stall_ms": 1e3 * statistics.median([r.stall_s for r in recs]) if recs else 0.0,
                         "bytes_per_iter": sum(r.bytes for r in recs) / max(len(its), 1),
                         "bytes_per_recovery_point": rp}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if dist.get_rank() == 0:
        base_t = statistics.median([g["none"]["median_s"] for g in gathered])
        base_cpu = statistics.median([g["none"]["median_cpu_s"] for g in gathered])
        report = {}
        for name in POLICIES:
            med = statistics.median([g[name]["median_s"] for g in gathered])
            cpu = statistics.median([g[name]["median_cpu_s"] for g in gathered])
            report[name] = {"overhead_ratio": round(med / base_t, 4),
                            "cpu_ratio": round(cpu / base_cpu, 4),
                            "hook_cpu_ms": round(statistics.median(g[name]["hook_cpu_ms"] for g in gathered), 3),
                            "stall_ms": round(max(g[name]["stall_ms"] for g in gathered), 4),
                            "hook_ms": round(statistics.median(g[name]["hook_ms"] for g in gathered), 3),
                            "thread_cpu_ms": round(statistics.median(g[name]["thread_cpu_ms"] for g in gathered), 3),
                            "bytes_per_iter": int(max(g[name]["bytes_per_iter"] for g in gathered)),
                            "bytes_per_recovery_point": int(max(g[name]["bytes_per_recovery_point"] for g in gathered))}
        report["_setup"] = {"window": WINDOW, "dense_k": DENSE_K, "iterations": args.training.train_iters,
                            "median_iter_s_none": round(base_t, 4), "median_iter_cpu_s_none": round(base_cpu, 4)}
        with open(out, "w") as f:
            json.dump(report, f)


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 measured cycles instead of 10 (< 3 min on 2 cores)")
    p.add_argument("--json", action="store_true", help="print one JSON object keyed by policy")
    p.add_argument("--data-path", default=None, help="indexed dataset prefix (default: a generated corpus)")
    p.add_argument("--nproc", type=int, default=4, choices=sorted(PP),
                   help="training processes: 4 (EP=2 x PP=2, default) or 2 (EP=2, one stage: one process per core)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckpt_overhead_") as tmp, \
            tempfile.TemporaryDirectory(prefix="moe_ft_bench_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        data = a.data_path
        if data is None:
            sys.path.insert(0, ROOT)
            from tools.make_corpus import write_corpus
            from tools.preprocess_data import preprocess

            write_corpus(os.path.join(tmp, "c.jsonl"), num_docs=300, seed=0)
            preprocess(os.path.join(tmp, "c.jsonl"), os.path.join(tmp, "corpus"))
            data = os.path.join(tmp, "corpus")
        cycles = 1 + (3 if a.quick else 10)
        iters = cycles * WINDOW * len(POLICIES)
        out = os.path.join(tmp, "report.json")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}", __file__,
               "--worker", "--out", out, *MODEL, "--pipeline-model-parallel-size", str(PP[a.nproc]),
               "--train-iters", str(iters), "--log-interval", str(iters),
               "--data-path", data, "--ft", "--ft-store-dir", shm, "--ft-sparse-window", str(WINDOW)]
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
            return proc.returncode
        report = json.load(open(out))
    if a.json:
        print(json.dumps({k: v for k, v in report.items() if not k.startswith("_")}))
    else:
        print(f"{'policy':10s} {'overhead':>9s} {'cpu ratio':>9s} {'stall ms':>9s} {'hook ms':>8s} {'hook cpu':>8s} "
              f"{'thread ms':>10s} {'bytes/iter':>12s} {'bytes/recovery pt':>18s}")
        for name in POLICIES:
            r = report[name]
            print(f"{name:10s} {r['overhead_ratio']:9.3f} {r['cpu_ratio']:9.3f} {r['stall_ms']:9.3f} {r['hook_ms']:8.2f} "
                  f"{r['hook_cpu_ms']:8.2f} {r['thread_cpu_ms']:10.2f} {r['bytes_per_iter']:12d} "
                  f"{r['bytes_per_recovery_point']:18d}")
        print(json.dumps(dict(report["_setup"], nproc=a.nproc)))
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        sys.exit(worker(sys.argv[1:]))
    sys.exit(main())
