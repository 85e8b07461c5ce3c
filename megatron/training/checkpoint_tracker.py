"""The tracker file that names a checkpoint root's newest complete checkpoint (Megatron-LM's layout).

Kept apart from :mod:`megatron.training.checkpointing` so that flag validation reads it without building
on the model and Megatron-Core's checkpointing (``checkpointing`` imports the model module, which imports
the arguments).
"""

from __future__ import annotations

import os

TRACKER_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message says which and why."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> int | None:
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    try:
        return int(text)
    except ValueError as e:
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number; fix or delete it") from e


def missing_checkpoint(root: str) -> str:
    """Why ``root`` (``--load``) holds no checkpoint, for the line that says so."""
    if not os.path.isdir(root):
        return f"--load {root}: no such directory"
    return (f"--load {root}: no {TRACKER_FILE}, so no complete checkpoint (nothing was saved there, or the save "
            "did not finish)")


def latest_checkpoint(root: str) -> tuple[int, str]:
    """``(iteration, directory)`` of the newest complete checkpoint under ``root`` (``--load``); raises
    :class:`CheckpointError` with one line when there is none."""
    iteration = read_latest_iteration(root)
    if iteration is None:
        raise CheckpointError(f"{missing_checkpoint(root)}; pass the --save directory of a finished run, or leave "
                              "--load out to start from scratch")
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"--load {root}: {TRACKER_FILE} names iteration {iteration} but {path} is missing")
    return iteration, path
