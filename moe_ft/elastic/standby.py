"""Ranks beyond the usable world wait as spares (``--ft-elastic``, a global batch the world does not split over).

A world of ``W`` ranks whose data-parallel size does not divide the global batch trains on the largest
``U < W`` that does (:func:`~moe_ft.elastic.reshape.usable_world_size`, decided while the flags are parsed,
the same on every rank); ranks ``U … W - 1`` take no part in it:

* under ``moe-ft launch`` such a rank publishes what it held (the caller spilled its survivor point to the
  node store first), says so in the launch store (``standby/<attempt>/<rank>``, which the training ranks
  wait for before they read the node stores) and exits with
  :data:`~moe_ft.launch.protocol.STANDBY_EXIT_CODE`; its agent starts a warm spare on its device, which takes
  the next failed rank;
* under torchrun it waits until rank 0 says the job ended (a key in the agent's store for this restart)
  and exits 0; the next restart (a failure anywhere) sees the world again and may give it a rank.

The training ranks take ``WORLD_SIZE = U`` (the default process group is formed by them alone).
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

from moe_ft.launch import protocol

POLL_S = 0.5


def launched_world(args) -> int:
    """The world the launcher started (``WORLD_SIZE``); ``args.world_size`` is the part that trains."""
    elastic = args.extra.get("ElasticConfig")
    return max(getattr(elastic, "launched_world", 0), args.world_size)


def standby_ranks(args) -> list[int]:
    return list(range(args.world_size, launched_world(args)))


def enter(args, membership) -> int | None:
    """After the flags are parsed: ``None`` for a rank that trains (``WORLD_SIZE`` set to the usable world,
    and under ``moe-ft launch`` after a reshaped attempt, the standby ranks' spills waited for); else this
    rank waits as a spare and the exit code is returned."""
    rank = int(os.environ.get("RANK", "0"))
    standby = standby_ranks(args)
    if not standby:
        return None
    if rank not in standby:
        os.environ.update(WORLD_SIZE=str(args.world_size), ROLE_WORLD_SIZE=str(args.world_size))
        if membership.inprocess and membership.resized:  # their held points are in the node stores first
            membership.wait_for_standbys(standby, protocol.reform_timeout_s())
        return None
    print(f"moe-ft elastic: rank {rank} waits as a spare: the global batch trains on {args.world_size} of the "
          f"{launched_world(args)} ranks", file=sys.stderr, flush=True)
    if membership.inprocess:
        membership.stand_by(args.world_size)
        return protocol.STANDBY_EXIT_CODE
    _wait_for_end()
    return 0


def _done_key() -> str:
    return (f"moe_ft/standby/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/done")


def _store():
    import torch.distributed as dist  # start-up time: flag parsing stays free of torch.distributed

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=300))


def _wait_for_end() -> None:
    """torchrun: block until rank 0 marks this restart's training done (torchrun's agent stops this process
    with the others on a restart)."""
    store, key = _store(), _done_key()
    while not store.check([key]):
        time.sleep(POLL_S)


def mark_done(args, membership) -> None:
    """Rank 0, after training ended: release the ranks waiting under torchrun (nothing to do without any).
    Under ``moe-ft launch`` the agents watch ``done`` themselves (a node left with spares only ends then)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    if membership.inprocess:
        membership.mark_done()
    elif standby_ranks(args):
        _store().set(_done_key(), "1")
