"""The fault-tolerance runtime the training loop calls (``hooks.FTRuntime``), its components and the
context they are built from. See ``docs/architecture.md``."""

from moe_ft.runtime.context import BuildContext
from moe_ft.runtime.hooks import FTRuntime, build_runtime

__all__ = ["BuildContext", "FTRuntime", "build_runtime"]
