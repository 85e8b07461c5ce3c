"""A torchrun agent that joins the job only when told (elastic drills, ``moe_ft/drills/cluster.py``).

    python -m moe_ft.drills.join TRIGGER LAUNCHER <torchrun arguments>

Importing torch costs seconds of CPU; a node that "comes back at iteration ITER" would otherwise join the
rendezvous seconds after the driver saw ITER completed, and a short job can end before that. This launcher
pays the imports first, waits until the driver creates ``TRIGGER``, then runs the launcher's ``main`` (``torchrun``,
``preloaded``: ``moe_ft.drills.prelaunch``, or ``moe-ft launch``) with the given arguments: the agent joins the running rendezvous within a poll interval, the running agents see a
waiting node and restart their workers on the larger world.
"""

from __future__ import annotations

import os
import sys
import time

from torch.distributed import run

from moe_ft.drills import prelaunch
from moe_ft.drills.launchers import LAUNCHERS
from moe_ft.launch import cli as launch_cli


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in LAUNCHERS:
        print(f"usage: python -m moe_ft.drills.join TRIGGER {{{','.join(LAUNCHERS)}}} <torchrun arguments>",
              file=sys.stderr)
        return 2
    trigger, launcher, torchrun_args = argv[0], argv[1], argv[2:]

    while not os.path.exists(trigger):
        time.sleep(0.05)
    if launcher.startswith("inprocess"):
        launch_cli.main([*LAUNCHERS[launcher][1:], *torchrun_args])
    else:
        (run.main if launcher == "torchrun" else prelaunch.main)(torchrun_args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
