"""Shared helpers of the moe-ft tests (one module instead of a copy per file):

* :func:`tiny_model_flags`: the tiny MoE GPT's Megatron flags for a parallel layout;
* :func:`one_rank_gloo` and :func:`one_rank_megatron`: a one-rank world (gloo on a ``HashStore``, and
  Megatron's ``parallel_state`` on top of it), torn down on exit (the ``megatron_world`` fixture of
  ``tests/conftest.py`` wraps the second);
* :func:`make_corpus` (the session-scoped ``corpus`` fixture) and a :func:`torchrun` launcher (4 ranks,
  1 thread each, gloo);
* :func:`wait_until`: wait on a condition with a bound, instead of a sleep followed by an assert;
* :func:`check_restart_kind`: a drill's recovery report says how its processes came back.

The worker scripts (``tests/_workers_*.py``) import this module too: it imports Megatron only inside the
functions that need it (start-up time of every process that imports it).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ----------------------------------------------------------------------------------------- model flags
TINY_MODEL: dict[str, object] = {
    "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 32, "num_experts": 4,
    "moe_router_topk": 2, "micro_batch_size": 2, "global_batch_size": 8,
}
"""The tiny MoE GPT every test trains (a few thousand parameters per expert): 2 layers of 4 experts, top-2."""

LAYOUTS: dict[str, dict[str, object]] = {
    "single": {},  # one rank, or plain data parallelism over the launched ranks
    "ep2": {"expert_model_parallel_size": 2},
    "ep4": {"expert_model_parallel_size": 4},
    "pp2": {"pipeline_model_parallel_size": 2},
    "ep2pp2": {"expert_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    # data parallelism with the optimizer state sharded over the data-parallel ranks
    "dp2ep2": {"expert_model_parallel_size": 2, "use_distributed_optimizer": True},
    # four pipeline stages of one layer each
    "pp4": {"pipeline_model_parallel_size": 4, "expert_model_parallel_size": 1, "num_layers": 4},
    # two pipeline ranks x two virtual stages of one layer each (interleaved 1F1B), EP=2 inside each stage
    "pp2vp2": {"pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2, "num_layers": 4,
               "num_layers_per_virtual_pipeline_stage": 1},
}
"""Parallel layouts by name (4 ranks unless named ``single``); only the parallel sizes, nothing else."""


def flags_of(options: dict[str, object]) -> list[str]:
    """``{"hidden_size": 32, "bf16": True, "split": (98, 2, 0), "seed": None}`` ->
    ``["--hidden-size", "32", "--bf16", "--split", "98", "2", "0"]``: ``True`` is a bare switch, ``None``
    or ``False`` leaves the flag out, a tuple or list gives several values."""
    argv: list[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        argv.append("--" + name.replace("_", "-"))
        if value is True:
            continue
        argv += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return argv


def tiny_model_flags(layout: str = "single", **overrides: object) -> list[str]:
    """Megatron flags of the tiny MoE GPT (:data:`TINY_MODEL`) in ``layout`` (a key of :data:`LAYOUTS`).
    ``overrides`` change, add (``lr=3e-3``) or drop (``seq_length=None``) flags by their dest name; see
    :func:`flags_of`. Each flag appears once."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {sorted(LAYOUTS)}")
    return flags_of({**TINY_MODEL, **LAYOUTS[layout], **overrides})


# -------------------------------------------------------------------------------------- one-rank world
@contextlib.contextmanager
def one_rank_gloo(timeout_s: float = 60) -> Iterator[None]:
    """A one-rank gloo process group on an in-memory ``HashStore`` (no port, no file), destroyed on exit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_megatron() -> Iterator[None]:
    """A one-rank Megatron world: one thread, deterministic algorithms, the CPU compatibility layer, a
    one-rank gloo group and Megatron's ``parallel_state`` initialised (every size 1); all undone on exit."""
    # Megatron is imported here, not at the top: start-up time of the modules importing the helpers
    from megatron.core import parallel_state as ps

    from megatron.training.initialize import quiet_optional_dependency_warnings
    from moe_ft.compat import cpu as cpu_compat

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    quiet_optional_dependency_warnings()
    cpu_compat.activate()
    try:
        with one_rank_gloo():
            ps.initialize_model_parallel()
            try:
                yield
            finally:
                ps.destroy_model_parallel()
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


# -------------------------------------------------------------------------------------------- waiting
def wait_until(predicate: Callable[[], object], timeout: float = 10.0, interval: float = 0.01,
               message: str = "") -> object:
    """Poll ``predicate`` until it returns a truthy value (returned) or ``timeout`` seconds pass
    (``AssertionError`` with ``message``)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout} s" + (f": {message}" if message else ""))
        time.sleep(interval)


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and wait until every thread of it is stopped. A stop takes effect when each
    thread next runs: until then a thread that gets the CPU first (a niced agent's, on a loaded machine) may
    still answer a request sent after the signal."""

    from moe_ft.agent.server import proc_stat  # the agent's reading of /proc/<pid>/stat (a thread's too)

    def stopped() -> bool:
        states = [stat[0] for tid in os.listdir(f"/proc/{pid}/task") if (stat := proc_stat(int(tid)))]
        return bool(states) and set(states) <= {"T", "t"}

    os.kill(pid, signal.SIGSTOP)
    wait_until(stopped, timeout=timeout, message=f"process {pid} stopped")


# ------------------------------------------------------------------------------------ corpus, torchrun
def free_port() -> int:
    """A TCP port of this host that no process listens on now (for a store or a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_corpus(directory: str) -> str:
    """Prefix of a small Megatron indexed dataset (300 generated documents) written under ``directory``."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tools.preprocess_data import generated_dataset

    return generated_dataset(directory, num_docs=300)


def torchrun(script: str, args: list[str], nproc: int = 4, timeout: float = 240, check: bool = True,
             launcher: str = "moe_ft.drills.prelaunch", max_restarts: int = 0):
    """Run ``script`` (relative to the repository) under ``torchrun --standalone`` with ``nproc`` ranks of
    one thread each; with ``check``, a non-zero exit raises with the output's tail. ``launcher``: the
    ``-m`` module (default: torchrun's agent with workers forked after the imports, ``moe_ft/drills/
    prelaunch.py``; ``torch.distributed.run`` for plain torchrun); ``max_restarts``: torchrun's."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", launcher, "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", os.path.join(ROOT, script), *args]
    with subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as popen:
        try:
            out, err = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # every worker prints its stacks (SIGUSR1), then the tree goes
            from moe_ft.drills.processes import dump_stacks_then_kill

            dump_stacks_then_kill(popen.pid)
            out, err = popen.communicate()
            raise AssertionError(f"{script} timed out after {timeout} s; the workers' stacks:\n{err[-12000:]}") from None
    proc = subprocess.CompletedProcess(cmd, popen.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def check_restart_kind(report: dict, launcher: str | None = None) -> None:
    """Under ``moe-ft launch`` (the drills' default, ``moe_ft.drills.launchers``) a recovery after a killed
    worker was in-process and every surviving rank kept its process; under torchrun every worker restarted."""
    from moe_ft.drills.launchers import default_launcher

    if (launcher or default_launcher()).startswith("inprocess"):
        assert (report["restart_kind"], report["survivor_pids_kept"]) == ("inprocess", True), report["restart_kind"]
    else:
        assert (report["restart_kind"], report["survivor_pids_kept"]) == ("job", None), report["restart_kind"]


def damage_arena_blob(backend, iteration: int, blob: str, fn: Callable[[bytes], bytes | None]) -> None:
    """Edit blob ``blob`` of an arena store's published point in place: ``fn`` gets its bytes and returns
    the new ones (same length or shorter: a torn blob) or ``None`` (the blob is gone from the index)."""
    import json

    index = backend.points_dir / f"{iteration:012d}.json"
    data = json.loads(index.read_text())
    seg, off, n = data["blobs"][blob]
    path = backend.arena_dir / f"{seg:04d}"
    with open(path, "r+b") as f:
        f.seek(off)
        new = fn(f.read(n))
        if new is not None:
            assert len(new) <= n, "an arena blob can be damaged in place, not grown"
            f.seek(off)
            f.write(new)
    if new is None:
        del data["blobs"][blob]
    else:
        data["blobs"][blob][2] = len(new)
    index.write_text(json.dumps(data))


def damage_blob(store, iteration: int, blob: str, fn: Callable[[bytes], bytes | None]) -> None:
    """Damage blob ``blob`` of published point ``iteration`` of ``store`` (a ``SnapshotStore`` of either
    node-local layout); see :func:`damage_arena_blob`."""
    from moe_ft.store import ArenaBackend

    if isinstance(store.backend, ArenaBackend):
        damage_arena_blob(store.backend, iteration, blob, fn)
        return
    path = store.backend.points_dir / f"{iteration:012d}" / blob
    new = fn(path.read_bytes())
    path.unlink() if new is None else path.write_bytes(new)


def flip_middle_byte(data: bytes) -> bytes:
    return data[: len(data) // 2] + bytes([data[len(data) // 2] ^ 0xFF]) + data[len(data) // 2 + 1:]


def held_replica_store(store_root, job_id: str, owner: int):
    """The replica store of rank ``owner`` in a job of nodes simulated in one store root (``--ft-ranks-per-node``,
    one replica): each holder keeps its replicas in a directory of its own (``replicas/holder<rank>``)."""
    from pathlib import Path

    from moe_ft.replication import replica_store_config

    (held,) = (Path(store_root) / job_id / "replicas").glob(f"holder*/rank{owner}")
    return replica_store_config(root=str(store_root), job_id=job_id, owner=owner,
                               holder=int(held.parent.name.removeprefix("holder"))).build()
