"""The fault-tolerance runtime the training loop calls (``hooks.FTRuntime``), its components and the
context they are built from. See ``docs/architecture.md``.

This ``__init__`` imports nothing: components import ``moe_ft.runtime.components`` and the runtime imports
every component, so re-exporting the runtime here would make each component import itself back."""
