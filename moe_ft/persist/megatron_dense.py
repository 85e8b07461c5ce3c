"""Dense recovery points in Megatron ``dist_checkpointing`` format, written in the background (MoC §5.1:
the durable copy of a dense point must be loadable by plain Megatron).

The layout is ``megatron/training/checkpointing.py``'s (``<root>/iter_<n>/`` + ``latest_checkpointed_
iteration.txt``, written only once every rank finished), reused through its state-dict builder, so
``load_checkpoint`` / ``--load`` read it. ``dist_checkpointing.save`` is collective on the default group, so
:meth:`save` runs on the training thread right after the optimizer step of the point (the live state *is*
the dense point then); with ``async_sharded_save`` megatron-core only plans the write there and hands it
to a forked writer process, whose copy-on-write memory keeps the state of that moment while training goes
on. :meth:`poll` (every iteration, collective) finalizes finished saves: the tracker file is written then.
"""

from __future__ import annotations

import os

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from megatron.training.checkpoint_tracker import TRACKER_FILE, checkpoint_dir, read_latest_iteration
from megatron.training.checkpointing import checkpoint_state_dict
from moe_ft import comm
from moe_ft.compat import writer_queue


class MegatronDenseWriter:
    def __init__(self, root: str, state) -> None:
        writer_queue.install()  # no Manager server process that would outlive a killed rank
        self.root, self.state = root, state
        self.queue = AsyncCallsQueue(persistent=False)
        self.saved: list[int] = []

    def save(self, iteration: int) -> None:
        """Start writing the state after ``iteration`` completed iterations (collective)."""

        path = checkpoint_dir(self.root, iteration)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        comm.barrier()  # host coordination: the directory exists before any rank writes into it
        # the state dict ``save_checkpoint`` writes: with its world size and padded vocabulary, --load of this
        # copy works at another world size exactly as of a --save checkpoint
        sharded = checkpoint_state_dict(self.state, iteration)
        request = dist_checkpointing.save(sharded, path, async_sharded_save=True)

        def publish() -> None:  # runs on every rank once all ranks' writes are done
            newer = read_latest_iteration(self.root)  # --save in the same directory may have moved on
            if dist.get_rank() == 0 and (newer is None or newer < iteration):
                tmp = os.path.join(self.root, TRACKER_FILE + ".tmp")
                with open(tmp, "w") as f:
                    f.write(str(iteration))
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, os.path.join(self.root, TRACKER_FILE))
            self.saved.append(iteration)

        request.add_finalize_fn(publish)
        self.queue.schedule_async_request(request)

    def poll(self) -> None:
        """Finalize the saves every rank has finished (collective; every iteration)."""
        self.queue.maybe_finalize_async_calls(blocking=False)

    def close(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)
        self.queue.close()
