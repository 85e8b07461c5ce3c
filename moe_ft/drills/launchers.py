"""The launchers a drill can start its agents with, by name (light: no torch import)."""

from __future__ import annotations

import os

LAUNCHERS = {
    "torchrun": ["torch.distributed.run"],
    "preloaded": ["moe_ft.drills.prelaunch"],
    "inprocess": ["moe_ft.launch", "--spares-per-node=1"],
    "inprocess-preloaded": ["moe_ft.launch", "--spares-per-node=1", "--preload"],
}
"""Drill launchers by name: the ``-m`` module each agent runs and its own flags (all take torchrun's flags).
``inprocess``: ``moe-ft launch`` with one warm spare (survivors keep their processes); ``*preloaded``:
workers forked from a launcher that imported the training stack once (tests)."""

LAUNCHER_ENV = "MOE_FT_DRILL_LAUNCHER"
"""Environment variable naming the drills' default launcher (unset: ``inprocess``)."""


def default_launcher() -> str:
    """The launcher a drill uses when its caller names none: ``$MOE_FT_DRILL_LAUNCHER`` or ``inprocess``."""
    name = os.environ.get(LAUNCHER_ENV, "inprocess")
    launcher_argv(name)
    return name


def launcher_argv(name: str) -> list[str]:
    """``["-m", module, flags...]`` of launcher ``name``; a ``ValueError`` names the choices."""
    if name not in LAUNCHERS:
        raise ValueError(f"unknown drill launcher {name!r} (${LAUNCHER_ENV} or --launcher): choose one of "
                         f"{', '.join(LAUNCHERS)}")
    return ["-m", *LAUNCHERS[name]]
