"""Imported second by the preloading fork server (``prelaunch.PRELOAD``), after ``hold_warnings``: imports
Megatron-Core with its ``torch.compile``'d fusions wrapped at their first call
(``megatron/training/deferred_compile.py``), as the entry script does in a worker started as a fresh process.
Every forked worker inherits the deferred functions; each decides at its first call, in the worker, whether to
compile (a GPU) or to run the function as written (a CPU)."""

from megatron.training.deferred_compile import import_megatron_core

import_megatron_core()
