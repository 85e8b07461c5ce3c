"""Imported first by the preloading fork server (``prelaunch.PRELOAD``): holds Megatron-Core's expected
warnings back (``megatron/training/quiet.py``) before the training stack's imports emit them, as the entry
script does in a worker started as a fresh process. Every forked worker inherits what was held, and rank 0
sums it up in one line; ``--verbose`` prints it."""

from megatron.training.quiet import hold

hold()
