"""The training thread's time inside the FT runtime's hooks, per hook and per step of them, on CPU: what the
fault tolerance costs the thread that launches the model's work, besides the snapshot threads.

    python -m tools.bench.ft_hooks [--iters 120] [--window 8] [--runs 2] [--root OTHER_CHECKOUT] [--json]
                                   [--extra "--ft-snapshot-copy-by kernel"]

Each run is ``torchrun --nproc-per-node 1`` of the real entry point (``pretrain_gpt_moe.py``): a tiny MoE GPT
(4 layers of 8 experts top-2, hidden 64, seq 64; 42 operators), ``--ft --ft-policy sparse
--ft-sparse-window W`` and ``--extra``'s flags, the store on ``/dev/shm`` when it exists, trained on ``data/corpus``
(``examples/prepare_data.sh``) or, without it, 2000 documents generated here. On a GPU host the same run
measures the GPU path's hooks (the copy into the arena and its device hash queued by ``submit``): the operators
are as many as in ``tools/bench/gpu_overhead.py``'s model, and the hooks' cost is per operator, not per byte. The worker wraps the runtime's hooks and
the functions they call (the plan, the step metadata and its parts, the popularity counters, the engine's
``submit``, the progress record) and sums, on the training thread only, each one's wall time and its thread
CPU time (``time.thread_time``: what it computed, without the time it waited for the GIL) over the
iterations after ``--warmup``. Prints per function the median over runs of ms per iteration, wall and CPU.
A function another checkout lacks is left out of its rows (``--root``: measure an older tree with the same
harness, for a before/after comparison run side by side).

The CPU compatibility layer's torch-function mode (``moe_ft/compat/cpu.py``) makes every tensor call through
Python cost ~10 us more than on a GPU host, so the absolute numbers are this machine's; the count of calls and
the Python around them are the same on a GPU.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import runpy
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TIMED = [
    ("moe_ft.runtime.hooks", "FTRuntime.on_step_begin"),
    ("moe_ft.runtime.hooks", "FTRuntime.before_optimizer_step"),
    ("moe_ft.runtime.hooks", "FTRuntime.on_step_end"),
    ("moe_ft.runtime.hooks", "FTRuntime.after_log"),
    ("moe_ft.runtime.hooks", "FTRuntime._snapshot"),
    ("moe_ft.runtime.hooks", "FTRuntime._log"),
    ("moe_ft.runtime.hooks", "FTRuntime.check_fault"),
    ("moe_ft.runtime.hooks", "capture_step_meta"),
    ("moe_ft.snapshot.meta", "capture_rng"),
    ("moe_ft.snapshot.meta", "capture_param_groups"),
    ("moe_ft.snapshot.meta", "expert_biases"),
    ("moe_ft.popularity", "ExpertPopularity.end_iteration"),
    ("moe_ft.popularity", "ExpertPopularity.mark_full"),
    ("moe_ft.popularity", "ExpertPopularity.state_dict"),
    ("moe_ft.policy.sparse", "SparsePolicy.plan"),
    ("moe_ft.policy.sparse", "SparsePolicy.state_dict"),
    ("moe_ft.snapshot.engine", "SnapshotEngine.submit"),
    ("moe_ft.snapshot.engine", "SnapshotEngine._stage_meta"),
    ("moe_ft.runtime.components", "write_progress"),  # before the record was rewritten in place
    ("moe_ft.recovery.progress", "ProgressFile.write"),
]
"""(module, attribute path) of the functions timed; each is replaced where it is looked up (a function
imported by name into a module is timed in that module)."""


def _model_flags(iters: int, window: int, data: str, store: str) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
            "--seq-length", "64", "--max-position-embeddings", "64", "--num-experts", "8", "--moe-router-topk", "2",
            "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "5", "--weight-decay", "0.01", "--clip-grad", "1.0",
            "--seed", "1234", "--data-path", data, "--split", "98,2,0", "--tokenizer-type", "ByteLevel",
            "--log-interval", "10", "--eval-interval", "0", "--save-interval", "0",
            "--ft", "--ft-policy", "sparse", "--ft-sparse-window", str(window), "--ft-store-dir", store]


class _Timers:
    """Wall and thread-CPU seconds per timed function, on one thread, from iteration ``start`` on."""

    def __init__(self, start: int) -> None:
        self.owner = threading.get_ident()
        self.start, self.iteration = start, -1
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.iterations = 0

    def wrap(self, fn, label: str):
        def timed(*args, **kwargs):
            if threading.get_ident() != self.owner or self.iteration < self.start:
                return fn(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[label] = self.wall.get(label, 0.0) + time.perf_counter() - wall
                self.cpu[label] = self.cpu.get(label, 0.0) + time.thread_time() - cpu

        return timed

    def install(self) -> list[str]:
        """Wrap every function of :data:`TIMED` this checkout has; returns the labels wrapped."""
        wrapped = []
        for module_name, path in TIMED:
            owner: object = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for part in parents:
                owner = getattr(owner, part, None)
            fn = getattr(owner, name, None) if owner is not None else None
            if fn is None:
                continue
            label = path if parents else f"{module_name.rsplit('.', 1)[-1]}.{name}"
            setattr(owner, name, self.wrap(fn, label))
            wrapped.append(label)
        hooks = importlib.import_module("moe_ft.runtime.hooks")
        timed_end = hooks.FTRuntime.on_step_end

        def on_step_end(runtime, iteration, result):
            self.iteration = iteration
            self.iterations += iteration >= self.start
            return timed_end(runtime, iteration, result)

        hooks.FTRuntime.on_step_end = on_step_end
        return wrapped

    def rows(self) -> dict[str, list[float]]:
        n = max(self.iterations, 1)
        return {k: [1e3 * self.wall[k] / n, 1e3 * self.cpu[k] / n] for k in sorted(self.wall, key=lambda k: -self.wall[k])}


def worker(out: str, root: str, start: int, flags: list[str]) -> int:
    sys.path.insert(0, root)
    timers = _Timers(start)
    wrapped = timers.install()

    def dump() -> None:
        with open(out, "w") as f:
            json.dump({"iterations": timers.iterations, "wrapped": wrapped, "ms_wall_cpu": timers.rows()}, f)

    atexit.register(dump)
    sys.argv = ["pretrain_gpt_moe.py", *flags]
    runpy.run_path(os.path.join(root, "pretrain_gpt_moe.py"), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20, help="iterations left out at the start")
    p.add_argument("--window", type=int, default=8, help="--ft-sparse-window")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--root", default=None, help="a checkout whose moe_ft and entry point to measure (default: this one)")
    p.add_argument("--data-path", default=None, help="a dataset prefix (default: data/corpus, else generated)")
    p.add_argument("--extra", default="", help="more flags for the entry point, e.g. \"--ft-snapshot-copy-by kernel\"")
    p.add_argument("--json", action="store_true", help="one JSON object (default: a table)")
    a = p.parse_args(argv)
    if a.iters <= a.warmup or a.runs < 1 or a.window < 1:
        p.error("--iters must exceed --warmup; --runs and --window must be >= 1")
    if a.data_path is not None and not os.path.exists(a.data_path + ".bin"):
        p.error(f"no dataset at {a.data_path} (.bin/.idx): make one with `bash examples/prepare_data.sh` (it "
                "writes data/corpus), or leave --data-path out to have one generated")
    root = os.path.abspath(a.root or ROOT)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="ft_hooks_data_") as data_dir:
        data = a.data_path or os.path.join(ROOT, "data", "corpus")
        if not os.path.exists(data + ".bin"):
            sys.path.insert(0, ROOT)
            from tools.preprocess_data import generated_dataset

            data = generated_dataset(data_dir)
        runs = _runs(a, root, shm, data)
    if runs is None:
        return 1
    return _report(a, runs)


def _runs(a: argparse.Namespace, root: str, shm: str | None, data: str) -> list[dict] | None:
    runs = []
    for run in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="ft_hooks_", dir=shm) as store, \
                tempfile.TemporaryDirectory(prefix="ft_hooks_out_") as tmp:
            out = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   os.path.abspath(__file__), "--worker", out, root, str(a.warmup), "--",
                   *_model_flags(a.iters, a.window, data, store), *shlex.split(a.extra)]
            env = dict(os.environ, OMP_NUM_THREADS="1")
            proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0 or not os.path.exists(out):
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                print(f"ft_hooks: run {run} failed (rc {proc.returncode})", file=sys.stderr)
                return None
            with open(out) as f:
                runs.append(json.load(f))
    return runs


def _report(a: argparse.Namespace, runs: list[dict]) -> int:
    labels = sorted({k for r in runs for k in r["ms_wall_cpu"]},
                    key=lambda k: -statistics.median(r["ms_wall_cpu"].get(k, [0.0])[0] for r in runs))
    rows = {k: {"wall_ms": statistics.median(r["ms_wall_cpu"][k][0] for r in runs if k in r["ms_wall_cpu"]),
                "cpu_ms": statistics.median(r["ms_wall_cpu"][k][1] for r in runs if k in r["ms_wall_cpu"])}
            for k in labels}
    result = {"root": a.root or "this checkout", "runs": a.runs, "iterations_per_run": runs[0]["iterations"],
              "window": a.window, "extra": a.extra, "ms_per_iteration": rows}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{'per iteration (median of runs)':40s} {'wall ms':>8s} {'CPU ms':>8s}   root: {result['root']}")
        for k, v in rows.items():
            print(f"{k:40s} {v['wall_ms']:8.3f} {v['cpu_ms']:8.3f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sep = sys.argv.index("--")
        sys.exit(worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[sep + 1:]))
    sys.exit(main())
