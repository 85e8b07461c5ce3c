"""A failed formation of the default process group (an in-process attempt abandoned while forming its
groups) must not rename the next one: a survivor and a fresh spare have to meet under the same keys."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from megatron.training.initialize import init_default_group


def test_a_failed_formation_does_not_rename_the_next_default_group():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    with pytest.raises(dist.DistError):  # rank 1 never arrives
        dist.init_process_group("gloo", store=dist.PrefixStore("attempt_1", store), rank=0, world_size=2,
                                timeout=timedelta(seconds=1))
    assert not dist.is_initialized()
    assert dist.distributed_c10d._world.group_count == 1  # torch 2.13: the failed group kept its number
    init_default_group("gloo", 10, {"store": dist.PrefixStore("attempt_2", store), "rank": 0, "world_size": 1})
    try:
        assert dist.distributed_c10d._get_default_group().group_name == "0"  # as in a fresh process
    finally:
        dist.destroy_process_group()
