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
with the ``fork`` start method: each worker is a fork of this process that runs the script as
``__main__`` with its flags. Failures, signals and exit codes reach the agent as with torchrun: a worker
that exits non-zero or is killed fails the group, and the agent restarts it (or stops) by the same rules.

The forked workers run exactly the script's code; only the import cost moves. Plain ``torchrun`` stays the
launcher of real jobs and of ``moe-ft drill`` (``--launcher preloaded`` runs a drill under this one); the
test suite runs its drills under this one (``tests/conftest.py`` sets ``MOE_FT_DRILL_LAUNCHER``).
"""

from __future__ import annotations

import faulthandler
import importlib
import runpy
import signal
import sys
import uuid

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher.api import elastic_launch

PRELOAD = (
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


def preload(modules: tuple[str, ...] = PRELOAD) -> None:
    for name in modules:
        importlib.import_module(name)


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
    config.start_method = "fork"
    preload()
    elastic_launch(config=config, entrypoint=run_script)(args.training_script, *args.training_script_args)


if __name__ == "__main__":  # required: Megatron's checkpoint writer re-imports the main module
    main()
