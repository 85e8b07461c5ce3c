"""The launchers a drill can start its agents with, by name (light: no torch import)."""

from __future__ import annotations

import os

LAUNCHERS = {"torchrun": "torch.distributed.run", "preloaded": "moe_ft.drills.prelaunch"}
"""Drill launchers by name: the Python module each agent runs with ``-m`` (both take torchrun's flags)."""

LAUNCHER_ENV = "MOE_FT_DRILL_LAUNCHER"
"""Environment variable naming the drills' default launcher (unset: ``torchrun``)."""


def default_launcher() -> str:
    """The launcher a drill uses when its caller names none: ``$MOE_FT_DRILL_LAUNCHER`` or ``torchrun``."""
    name = os.environ.get(LAUNCHER_ENV, "torchrun")
    launcher_module(name)
    return name


def launcher_module(name: str) -> str:
    """The ``-m`` module of launcher ``name``; a ``ValueError`` names the choices."""
    if name not in LAUNCHERS:
        raise ValueError(f"unknown drill launcher {name!r} (${LAUNCHER_ENV} or --launcher): choose one of "
                         f"{', '.join(LAUNCHERS)}")
    return LAUNCHERS[name]
