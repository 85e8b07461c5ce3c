"""The training thread's time inside the FT runtime's hooks, per hook and per step of them, on CPU: what the
fault tolerance costs the thread that launches the model's work, besides the snapshot threads.

    python -m tools.bench.ft_hooks [--iters 120] [--window 8] [--runs 2] [--root CHECKOUT...] [--json]
                                   [--extra "--ft-snapshot-copy-by kernel"] [--interleave K] [--profile DIR]

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
harness, for a before/after comparison run side by side; with several roots the runs alternate between them,
``--runs`` each, and the result has one entry per root).

``--interleave K``: blocks of ``K`` iterations alternate between snapshots taken and paused inside each run
(``tools/bench/interleave.py``; a paused iteration gets no session, as in ``tools/bench/gpu_overhead.py
--interleave``), and the rows are per kind of block (``taken``, ``paused``; the first iteration of each block
counts for neither): their difference is what taking a snapshot costs the training thread. ``--profile DIR``:
the training thread's hooks under ``cProfile`` in the measured iterations, one ``pstats`` file per run and kind
of block in ``DIR`` (``python -m pstats``), and the top functions by own time in the JSON (``profile``). The
profiler's clock is the thread's CPU time: a wall clock would charge a function with the time its thread waited
for the GIL, which another thread held (any Python line may have to hand the GIL over after the switch interval).

The CPU compatibility layer's torch-function mode (``moe_ft/compat/cpu.py``) makes every tensor call through
Python cost ~10 us more than on a GPU host, so the absolute numbers are this machine's; the count of calls and
the Python around them are the same on a GPU.
"""

from __future__ import annotations

import argparse
import atexit
import cProfile
import importlib
import json
import os
import pstats
import runpy
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tools.bench import interleave

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


HOOKS = ("on_step_begin", "before_optimizer_step", "on_step_end", "after_log")
"""The runtime's hooks the training loop calls, each with the iteration as its first argument."""


class _Timers:
    """Wall and thread-CPU seconds per timed function and kind of iteration, on one thread, from iteration
    ``start`` on; ``block`` > 0: iterations of taken and paused blocks apart (module docstring)."""

    def __init__(self, start: int, block: int = 0, profile_dir: str = "") -> None:
        self.owner = threading.get_ident()
        self.start, self.block, self.iteration = start, block, -1
        self.wall: dict[str, dict[str, float]] = {}
        self.cpu: dict[str, dict[str, float]] = {}
        self.iterations: dict[str, int] = {}
        self.profile_dir = profile_dir
        self.profiles: dict[str, cProfile.Profile] = {}

    @property
    def kind(self) -> str | None:
        """The current iteration's kind (``None``: not measured)."""
        if self.iteration < self.start:
            return None
        return interleave.iteration_kind(self.iteration, self.block) if self.block else "all"

    def wrap(self, fn, label: str):
        def timed(*args, **kwargs):
            kind = self.kind
            if threading.get_ident() != self.owner or kind is None:
                return fn(*args, **kwargs)
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                walls, cpus = self.wall.setdefault(kind, {}), self.cpu.setdefault(kind, {})
                walls[label] = walls.get(label, 0.0) + time.perf_counter() - wall
                cpus[label] = cpus.get(label, 0.0) + time.thread_time() - cpu

        return timed

    def hook(self, fn, name: str):
        """The runtime's hook ``name``: sets the current iteration (and counts it at ``on_step_end``), then runs
        ``fn`` under the kind's profiler when ``profile_dir`` is set."""
        def hooked(runtime, iteration, *args):
            self.iteration = iteration
            kind = self.kind
            if name == "on_step_end" and kind is not None:
                self.iterations[kind] = self.iterations.get(kind, 0) + 1
            if not self.profile_dir or kind is None or threading.get_ident() != self.owner:
                return fn(runtime, iteration, *args)
            prof = self.profiles.setdefault(kind, cProfile.Profile(time.thread_time))  # CPU: no GIL waits
            prof.enable()
            try:
                return fn(runtime, iteration, *args)
            finally:
                prof.disable()

        return hooked

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
        runtime = importlib.import_module("moe_ft.runtime.hooks").FTRuntime
        for name in HOOKS:
            setattr(runtime, name, self.hook(getattr(runtime, name), name))
        if self.block:
            select, block = runtime.select_session, self.block

            def select_session(rt, iteration: int):  # a paused block's iteration takes no snapshot
                return None if interleave.snapshots_paused(iteration, block) else select(rt, iteration)

            runtime.select_session = select_session
        return wrapped

    def rows(self) -> dict[str, dict[str, list[float]]]:
        """Per kind: label -> [wall ms, CPU ms] per iteration of that kind."""
        out = {}
        for kind, wall in self.wall.items():
            n = max(self.iterations.get(kind, 0), 1)
            out[kind] = {k: [1e3 * wall[k] / n, 1e3 * self.cpu[kind][k] / n] for k in sorted(wall, key=lambda k: -wall[k])}
        return out

    def dump_profiles(self, tag: str, top: int = 25) -> dict[str, list]:
        """Write each kind's profile to ``profile_dir``; returns per kind the ``top`` functions by own time:
        ``[function, calls, own ms per iteration, cumulative ms per iteration]``."""
        out = {}
        for kind, prof in self.profiles.items():
            path = os.path.join(self.profile_dir, f"ft_hooks_{tag}_{kind}.prof")
            prof.dump_stats(path)
            stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
            n = max(self.iterations.get(kind, 0), 1)
            rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
            out[kind] = [[f"{os.path.basename(f)}:{line}({fn})", calls, round(1e3 * tt / n, 4), round(1e3 * ct / n, 4)]
                         for (f, line, fn), (_, calls, tt, ct, _) in rows]
        return out


def worker(out: str, root: str, start: int, block: int, profile_dir: str, flags: list[str]) -> int:
    sys.path.insert(0, root)
    timers = _Timers(start, block, profile_dir)
    wrapped = timers.install()

    def dump() -> None:
        profile = timers.dump_profiles(os.path.basename(os.path.dirname(out))) if profile_dir else {}
        with open(out, "w") as f:
            json.dump({"iterations": timers.iterations, "wrapped": wrapped, "ms_wall_cpu": timers.rows(),
                       "profile": profile}, f)

    atexit.register(dump)
    sys.argv = ["pretrain_gpt_moe.py", *flags]
    runpy.run_path(os.path.join(root, "pretrain_gpt_moe.py"), run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=120)
    p.add_argument("--warmup", type=int, default=20, help="iterations left out at the start")
    p.add_argument("--window", type=int, default=8, help="--ft-sparse-window")
    p.add_argument("--runs", type=int, default=2, help="runs per root")
    p.add_argument("--root", nargs="+", default=None,
                   help="checkouts whose moe_ft and entry point to measure, runs alternating (default: this one)")
    p.add_argument("--data-path", default=None, help="a dataset prefix (default: data/corpus, else generated)")
    p.add_argument("--extra", default="", help="more flags for the entry point, e.g. \"--ft-snapshot-copy-by kernel\"")
    p.add_argument("--interleave", type=int, default=0, metavar="K",
                   help="alternate blocks of K iterations with snapshots taken and paused (a multiple of --window); "
                        "rows per kind of block. 0: off")
    p.add_argument("--profile", default="", metavar="DIR", help="cProfile the hooks per kind of block into DIR")
    p.add_argument("--json", action="store_true", help="one JSON object (default: a table)")
    a = p.parse_args(argv)
    if a.iters <= a.warmup or a.runs < 1 or a.window < 1 or a.interleave < 0:
        p.error("--iters must exceed --warmup; --runs and --window must be >= 1, --interleave >= 0")
    if a.interleave and a.interleave % a.window:
        p.error(f"--interleave {a.interleave} is not a multiple of --window {a.window}: a paused block would cut a "
                "window (each operator is FULL once per window)")
    if a.interleave:
        try:
            interleave.interleaved_stats({t: 1.0 for t in range(a.warmup, a.iters)}, a.interleave)
        except ValueError as e:
            p.error(str(e))
    if a.data_path is not None and not os.path.exists(a.data_path + ".bin"):
        p.error(f"no dataset at {a.data_path} (.bin/.idx): make one with `bash examples/prepare_data.sh` (it "
                "writes data/corpus), or leave --data-path out to have one generated")
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    roots = [os.path.abspath(r) for r in (a.root or [ROOT])]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="ft_hooks_data_") as data_dir:
        data = a.data_path or os.path.join(ROOT, "data", "corpus")
        if not os.path.exists(data + ".bin"):
            sys.path.insert(0, ROOT)
            from tools.preprocess_data import generated_dataset

            data = generated_dataset(data_dir)
        runs = _runs(a, roots, shm, data)
    if runs is None:
        return 1
    return _report(a, roots, runs)


def _runs(a: argparse.Namespace, roots: list[str], shm: str | None, data: str) -> dict[str, list[dict]] | None:
    """``--runs`` runs of every root, alternating between the roots."""
    runs: dict[str, list[dict]] = {root: [] for root in roots}
    for run in range(a.runs):
        for r, root in enumerate(roots):
            with tempfile.TemporaryDirectory(prefix="ft_hooks_", dir=shm) as store, \
                    tempfile.TemporaryDirectory(prefix=f"ft_hooks_out_r{r}_{run}_") as tmp:
                out = os.path.join(tmp, "rows.json")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                       os.path.abspath(__file__), "--worker", out, root, str(a.warmup), str(a.interleave),
                       a.profile and os.path.abspath(a.profile), "--",
                       *_model_flags(a.iters, a.window, data, store), *shlex.split(a.extra)]
                # this checkout's tools (the harness); the worker puts ``root`` first for moe_ft
                env = dict(os.environ, OMP_NUM_THREADS="1",
                           PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
                proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=1800)
                if proc.returncode != 0 or not os.path.exists(out):
                    sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                    print(f"ft_hooks: run {run} of {root} failed (rc {proc.returncode})", file=sys.stderr)
                    return None
                with open(out) as f:
                    runs[root].append(json.load(f))
    return runs


def _rows(runs: list[dict], kind: str) -> dict[str, dict[str, float]]:
    """label -> median over ``runs`` of wall and CPU ms per iteration of ``kind``."""
    per = [r["ms_wall_cpu"].get(kind, {}) for r in runs]
    labels = sorted({k for rows in per for k in rows},
                    key=lambda k: -statistics.median(rows.get(k, [0.0])[0] for rows in per))
    return {k: {"wall_ms": statistics.median(rows[k][0] for rows in per if k in rows),
                "cpu_ms": statistics.median(rows[k][1] for rows in per if k in rows)} for k in labels}


def _result(a: argparse.Namespace, root: str, runs: list[dict]) -> dict:
    kinds = ("taken", "paused") if a.interleave else ("all",)
    iterations = {kind: runs[0]["iterations"].get(kind, 0) for kind in kinds}
    result = {"root": root if a.root else "this checkout", "runs": a.runs, "window": a.window, "extra": a.extra}
    if not a.interleave:
        result.update(iterations_per_run=iterations["all"], ms_per_iteration=_rows(runs, "all"))
    else:  # the interleave module's kinds are "active" and "paused"
        rows = {"taken": _rows(runs, "active"), "paused": _rows(runs, "paused")}
        result.update(interleave=a.interleave, iterations_per_run={"taken": runs[0]["iterations"].get("active", 0),
                                                                   "paused": runs[0]["iterations"].get("paused", 0)},
                      ms_per_iteration=rows)
    if a.profile:
        result["profile"] = [r["profile"] for r in runs]
    return result


def _report(a: argparse.Namespace, roots: list[str], runs: dict[str, list[dict]]) -> int:
    results = [_result(a, root, runs[root]) for root in roots]
    if a.json:
        print(json.dumps(results[0] if len(results) == 1 else {"roots": results}))
        return 0
    for result in results:
        tables = result["ms_per_iteration"]
        if not a.interleave:
            tables = {"": tables}
        for kind, rows in tables.items():
            title = f"per iteration{' ' + kind if kind else ''} (median of runs)"
            print(f"{title:40s} {'wall ms':>8s} {'CPU ms':>8s}   root: {result['root']}")
            for k, v in rows.items():
                print(f"{k:40s} {v['wall_ms']:8.3f} {v['cpu_ms']:8.3f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sep = sys.argv.index("--")
        sys.exit(worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6],
                        sys.argv[sep + 1:]))
    sys.exit(main())
