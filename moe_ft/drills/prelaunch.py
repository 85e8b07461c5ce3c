"""torchrun whose workers are forked from a process that has already imported the training stack.

    python -m moe_ft.drills.prelaunch [torchrun flags] pretrain_gpt_moe.py [script flags]

Every worker torchrun starts is a new interpreter that imports torch, Megatron-Core and moe_ft before its
first line of work: about 4.5 s of CPU per worker on the CI machine, against about 0.2 s per training
iteration of the tiny drill model. Drills and the multi-process tests start hundreds of workers (every
``--max-restarts`` restart starts the whole group again), so the imports were most of their cost.

This launcher takes torchrun's own flags (``torch.distributed.run``'s parser: ``--standalone``,
``--nnodes``, ``--nproc-per-node``, ``--rdzv-*``, ``--max-restarts``, ``--monitor-interval`` ...), imports
the training stack once, and hands torch elastic's launcher (``elastic_launch``, the same
``LocalElasticAgent``, rendezvous, restarts and worker environment as torchrun) a function entrypoint
with the ``forkserver`` start method: each worker is a fork of one server process that imported the
training stack (:func:`use_preloaded_forkserver`) and runs the script as ``__main__`` with its flags.
Not a fork of the agent itself: by the time it starts workers the agent runs threads (its rendezvous
store's server, the rendezvous keep-alive) that may hold a lock at the moment of a fork, and a child
that inherits a held lock waits on it forever (the likely cause of a worker group once seen hanging,
under load, while it formed its gloo group). The fork server never runs a thread. Failures, signals and exit codes reach the agent as with torchrun: a worker
that exits non-zero or is killed fails the group, and the agent restarts it (or stops) by the same rules.

The forked workers run exactly the script's code; only the import cost moves. ``moe-ft drill --launcher
preloaded`` runs a drill under this launcher; ``moe-ft launch --preload`` uses its fork server
(:func:`use_preloaded_forkserver`), and the test suite runs its drills that way (``tests/conftest.py`` sets
``MOE_FT_DRILL_LAUNCHER=inprocess-preloaded``).
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import multiprocessing
import os
import runpy
import signal
import sys
import uuid
from multiprocessing import forkserver
from multiprocessing import util as mp_util
from typing import Any

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

from moe_ft.drills.faults import AGENT_PID_ENV
from moe_ft.launch.protocol import USAGE_EXIT_CODE

PRELOAD = (
    "moe_ft.drills.hold_warnings",  # first: before the imports that warn
    "moe_ft.drills.defer_compile",  # second: Megatron-Core imported with its compiled fusions deferred
    "megatron.training.arguments",
    "megatron.training.pretrain",
    "megatron.training.training",
    "megatron.training.model",
    "megatron.training.checkpointing",
    "moe_ft.compat",
    "moe_ft.compat.cpu",
    "moe_ft.config",
    "moe_ft.runtime.hooks",
    "moe_ft.localized.survivor",
)
"""What every worker of ``pretrain_gpt_moe.py`` imports before it parses its flags (imported here once;
a module the script does not need costs only this process's start-up)."""


def run_script(script: str, *script_args: str) -> int:
    """A worker: run ``script`` as ``__main__`` with ``script_args`` as its command line. A ``sys.exit``
    with a non-zero code leaves the worker with that exit status, as in a worker torchrun started. ``kill
    -USR1`` prints every thread's stack (a test helper that times out sends it before killing the tree),
    whatever the script."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")
    return 0


_SPAWNV_PASSFDS = mp_util.spawnv_passfds
START_METHOD = "forkserver"
"""The start method of preloaded workers (:func:`use_preloaded_forkserver`)."""


class PreloadError(RuntimeError):
    """The preloaded fork server would hand out workers that cannot use the GPU (one line: what, and the fix)."""


def cuda_fork_problem() -> str:
    """Why workers forked from this process could not use CUDA (``""``: they can). CUDA does not survive a
    fork: once this process initialised it, a forked child fails at its first CUDA call; and once it only asked
    the CUDA runtime for the device count (``torch.cuda.is_available()`` does, unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), torch marks every later fork as unable to initialise CUDA. Every
    preloaded worker is a fork of a fork of this process, so either state breaks all of them on a GPU node.
    The second is read from a throwaway fork (torch keeps the mark in the child; a torch built without CUDA
    has none to keep); it counts only when there is a GPU to use (a CPU job's workers never initialise
    CUDA)."""
    if torch.cuda.is_initialized():
        return ("importing the training stack initialised CUDA in the launcher, and a worker forked after that "
                "cannot use the GPU; drop --preload (each worker then imports the stack itself)")
    if torch.backends.cuda.is_built() and _fork_cannot_init_cuda() and torch.cuda.device_count() > 0:
        return ("importing the training stack queried the CUDA runtime in the launcher, and torch refuses CUDA "
                "in a worker forked after that; drop --preload (each worker then imports the stack itself), or "
                "set PYTORCH_NVML_BASED_CUDA_CHECK=1 so that torch.cuda.is_available() asks NVML instead")
    return ""


def _fork_cannot_init_cuda() -> bool:
    """Whether torch marks a fork of this process as unable to initialise CUDA (``_is_in_bad_fork``): read in
    a child that exits at once."""
    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 1


def import_stack(modules: tuple[str, ...] = PRELOAD) -> None:
    """Import ``modules`` in this process; one that fails is skipped here (the worker that needs it imports
    it again, with its error)."""
    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def use_preloaded_forkserver(modules: tuple[str, ...] = PRELOAD) -> str:
    """Import ``modules`` here, start multiprocessing's fork server as a fork of this process, wait until it
    serves, and return the start method that forks workers from it. The server is single-threaded and
    forked before the agent runs a thread, so every worker (restarts and spares included) is a fork of a
    process that holds no lock and no connection of the agent's. Forking the server, rather than starting
    a new interpreter that imports the stack again, saves the second import of torch (~1.5 s of CPU per
    launch). Importing here, before the rendezvous, keeps the imports out of the agent's first worker
    start: an agent blocked there for seconds sends no heartbeat and the other nodes' agents would declare
    its node lost. A module that fails to import here is imported again, with its error, by the worker
    that needs it. Raises :class:`PreloadError` when the imports left this process unable to fork workers
    that use CUDA (:func:`cuda_fork_problem`), before any server is started."""
    import_stack(modules)
    problem = cuda_fork_problem()
    if problem:
        raise PreloadError(problem)
    ctx = multiprocessing.get_context("forkserver")
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the workers' agent is their grandparent (kill_node)
    mp_util.spawnv_passfds = _fork_server  # type: ignore[assignment]
    try:
        ready = ctx.Process(target=os.getpid, name="moe-ft-forkserver-ready")
        ready.start()
        ready.join()
    finally:
        mp_util.spawnv_passfds = _SPAWNV_PASSFDS
    return START_METHOD


def _fork_server(path: Any, args: Any, passfds: Any) -> int:
    """What ``multiprocessing.forkserver`` calls to start its server (``util.spawnv_passfds``), done by a
    fork: the child keeps only the standard streams and the two descriptors the server is handed (its
    listening socket and the read end of the clients' liveness pipe) and runs the server loop, with
    nothing left to preload.

    The server starts a session of its own, which every worker forked from it inherits, as torch elastic
    starts each worker of a script (``start_new_session=True``): a terminal's Ctrl-C (SIGINT to its
    foreground process group), or its hang-up, then reaches the launcher only, which stops the workers
    with SIGTERM, the signal on which a worker writes the survivor point it holds. In the launcher's group, a
    forked worker got the SIGINT itself and died in a ``KeyboardInterrupt`` with its point."""
    if len(passfds) != 2:  # another Python's server protocol (3.11 and 3.12 pass these two): spawn it
        return _SPAWNV_PASSFDS(path, args, passfds)
    listener_fd, alive_r = passfds
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written again by the server's forks
        stream.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setsid()
        keep = sorted({0, 1, 2, listener_fd, alive_r})
        for low, high in zip(keep, [*keep[1:], os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        forkserver.main(listener_fd, alive_r, [])
    finally:
        os._exit(0)


@record
def main(argv: list[str] | None = None) -> None:
    args = torchrun.parse_args(argv)
    if args.standalone:  # what ``torchrun --standalone`` means: a private c10d rendezvous on this host
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.no_python or args.module:
        raise SystemExit("error: moe_ft.drills.prelaunch runs a Python script file; drop --no-python / -m")
    config, _, _ = torchrun.config_from_args(args)
    try:
        config.start_method = use_preloaded_forkserver()
    except PreloadError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(USAGE_EXIT_CODE) from None
    elastic_launch(config=config, entrypoint=run_script)(args.training_script, *args.training_script_args)


if __name__ == "__main__":  # required: Megatron's checkpoint writer re-imports the main module
    main()
