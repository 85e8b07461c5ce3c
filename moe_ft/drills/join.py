"""A torchrun agent that joins the job only when told (elastic drills, ``moe_ft/drills/cluster.py``).

    python -m moe_ft.drills.join TRIGGER LAUNCHER <torchrun arguments>

Importing torch costs seconds of CPU; a node that "comes back at iteration ITER" would otherwise join the
rendezvous seconds after the driver saw ITER completed, and a short job can end before that. This launcher
pays the imports first (with a preloading launcher, the training stack's too), says so by creating
``TRIGGER.ready.<pid>`` (:func:`ready_marker`), waits until the driver creates ``TRIGGER``, then runs the
launcher's ``main`` (``torchrun``, ``preloaded``: ``moe_ft.drills.prelaunch``, or ``moe-ft launch``) with the
given arguments: the agent joins the running rendezvous within a poll interval, the running agents see a
waiting node and restart their workers on the larger world.

An elastic job's first start goes through here too, all nodes on one trigger: with ``--nnodes 1:N`` the
rendezvous closes ``last_call_timeout`` after its first node joined, and agents that imported for
different times (a loaded machine) would start the job on fewer nodes than it has. The driver creates the
trigger once every agent is ready (:func:`release_when_ready`), so they reach the rendezvous together.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from moe_ft.drills.launchers import LAUNCHERS


def ready_marker(trigger: str, pid: int) -> str:
    """The file an agent waiting for ``trigger`` creates once its imports are done."""
    return f"{trigger}.ready.{pid}"


def release_when_ready(trigger: str, agents: int, give_up: Callable[[], bool], poll_s: float = 0.05) -> int:
    """Create ``trigger`` once ``agents`` agents waiting for it are ready (their :func:`ready_marker`), or
    at once when ``give_up()`` says so (an agent exited, time is up): the driver's loop handles that.
    Returns how many were ready."""
    while (ready := len(glob.glob(glob.escape(trigger) + ".ready.*"))) < agents and not give_up():
        time.sleep(poll_s)
    Path(trigger).touch()
    return ready


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in LAUNCHERS:
        print(f"usage: python -m moe_ft.drills.join TRIGGER {{{','.join(LAUNCHERS)}}} <torchrun arguments>",
              file=sys.stderr)
        return 2
    trigger, launcher, torchrun_args = argv[0], argv[1], argv[2:]
    # the drill driver imports this module without torch; the agent pays these imports here, before it says
    # it is ready (start-up time)
    from torch.distributed import run

    from moe_ft.drills import prelaunch
    from moe_ft.launch import cli as launch_cli

    if launcher == "preloaded" or "--preload" in LAUNCHERS[launcher]:
        prelaunch.import_stack()  # the launcher imports it before its rendezvous: here, before the trigger
    Path(ready_marker(trigger, os.getpid())).touch()
    while not os.path.exists(trigger):
        time.sleep(0.05)
    if launcher.startswith("inprocess"):
        launch_cli.main([*LAUNCHERS[launcher][1:], *torchrun_args])
    else:
        (run.main if launcher == "torchrun" else prelaunch.main)(torchrun_args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
