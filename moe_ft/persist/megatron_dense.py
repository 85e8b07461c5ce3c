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
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from torch.distributed.checkpoint.api import CheckpointException

from megatron.training.checkpoint_tracker import TRACKER_FILE, checkpoint_dir, read_latest_iteration
from megatron.training.checkpointing import checkpoint_state_dict
from moe_ft import comm
from moe_ft.compat import writer_queue
from moe_ft.store.capacity import existing_dir
from moe_ft.store.errors import store_full


def _tensors(values):
    """The tensors among a sharded state dict's values (``ShardedTensor.data``, plain tensors)."""
    for v in values:
        data = v.data if isinstance(v, ShardedTensor) else v
        if isinstance(data, torch.Tensor):
            yield data


def _directory_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


class MegatronDenseWriter:
    def __init__(self, root: str, state) -> None:
        writer_queue.install()  # no Manager server process that would outlive a killed rank
        self.root, self.state = root, state
        self.queue = AsyncCallsQueue(persistent=False)
        self.saved: list[int] = []
        self.pending: list[int] = []  # copies started and not finalized, oldest first
        self.last_bytes = 0
        """Bytes of the newest finished copy (0: none yet): what the next one needs on the file system."""
        self.paused = ""
        """Non-empty while the copies are paused: the directory's file system had no room for one."""

    def save(self, iteration: int) -> None:
        """Start writing the state after ``iteration`` completed iterations (collective). A copy the
        directory's file system has no room for is not started (:meth:`_fits`): the copies pause."""

        # the state dict ``save_checkpoint`` writes: with its world size and padded vocabulary, --load of this
        # copy works at another world size exactly as of a --save checkpoint
        sharded = checkpoint_state_dict(self.state, iteration)
        if not self._fits(sharded, iteration):
            return
        path = checkpoint_dir(self.root, iteration)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        comm.barrier()  # host coordination: the directory exists before any rank writes into it
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
            self.pending.remove(iteration)
            self.last_bytes = _directory_bytes(checkpoint_dir(self.root, iteration)) if dist.get_rank() == 0 else 0
            self.last_bytes = comm.broadcast_object(self.last_bytes)
            if self.paused:
                if dist.get_rank() == 0:
                    print(f"moe-ft durable copies resumed at iteration {iteration}: {self.root} has room again",
                          file=sys.stderr, flush=True)
                self.paused = ""

        request.add_finalize_fn(publish)
        self.pending.append(iteration)
        self.queue.schedule_async_request(request)

    def _fits(self, sharded, iteration: int) -> bool:
        """Collective: whether the copy of ``iteration`` fits the file system of the directory: the size of
        the previous copy (at first: every rank's tensors, replicas counted on every rank), 5 % and 1 MiB
        more, against rank 0's free space. Checked before the write starts: a copy that ran out of space
        while megatron-core's coordinator wrote its metadata would stop the coordinator alone, with the other
        ranks waiting on it. Otherwise the copies pause (:meth:`_pause`) and the next due one tries again."""
        need = self.last_bytes or comm.all_reduce_host(
            [sum(t.nbytes for t in _tensors(nested_values(sharded)))], op="sum")[0]
        free = comm.broadcast_object(shutil.disk_usage(existing_dir(Path(self.root))).free if dist.get_rank() == 0 else None)
        if need * 1.05 + 2**20 <= free:
            return True
        self._pause(iteration, f"{free / 2**20:.1f} MiB free, the copy needs about {need / 2**20:.1f} MiB")
        return False

    def _pause(self, iteration: int, why: str) -> None:
        if not self.paused:
            newest = read_latest_iteration(self.root)
            kept = f"the newest complete copy (iteration {newest}) is kept" if newest is not None else \
                "no copy is complete yet"
            if dist.get_rank() == 0:
                print(f"moe-ft durable copies paused (persist dir full) at iteration {iteration}: Megatron-format copy "
                      f"in {self.root}: {why}; training goes on, {kept}, copies resume when space returns",
                      file=sys.stderr, flush=True)
        self.paused = "persist dir full"

    def poll(self) -> None:
        """Finalize the saves every rank has finished (collective; every iteration). A copy whose writers ran
        out of space fails on every rank alike (megatron-core gathers the writers' results): its directory
        goes (no tracker names it, ``--load`` never reads it) and the copies pause."""
        try:
            self.queue.maybe_finalize_async_calls(blocking=False)
        except CheckpointException as e:
            if not any(store_full(exc) for exc, _ in e.failures.values()):
                raise
            failed = self.pending.pop(0)
            if dist.get_rank() == 0:
                shutil.rmtree(checkpoint_dir(self.root, failed), ignore_errors=True)
            self._pause(failed, "the writers found no space left on the device")

    def close(self) -> None:
        self.poll()
        self.queue.maybe_finalize_async_calls(blocking=True)
        self.queue.close()
