"""In-process recovery's device half on one GPU: a survivor aborts its NCCL communicators and forms the next
generation's groups in the same process (torch 2.13: ``ProcessGroupNCCL.abort`` from the notice thread,
``_abort_process_group`` when the main thread leaves the attempt).

The steps are the ones a survivor takes (``moe_ft.launch.worker.sever_peer_connections`` then
``megatron.training.initialize.shutdown(failed=True)`` and a new ``init_default_group`` with
Megatron-Core's parallel state): the first generation's communicators work, the abort reaches every NCCL
backend (the default group's and Megatron-Core's), an aborted group fails instead of computing, the
process leaves it without waiting, and the second generation computes the right sums on the same device.

One GPU allows a world of one rank only (NCCL refuses two ranks on one device), so a collective left
pending by a dead peer cannot be staged here; the multi-rank pending case runs on gloo in the CPU drills.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests._ft_helpers import free_port
from tests.gpu._results import record

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def _form(store, generation: int) -> None:
    from megatron.core import parallel_state as ps

    from megatron.training.initialize import init_default_group

    init_default_group("nccl", 60.0, {"store": dist.PrefixStore(f"generation_{generation}", store), "rank": 0,
                                      "world_size": 1})
    ps.initialize_model_parallel(expert_model_parallel_size=1, distributed_timeout_minutes=1)


def _sum_on_every_group(value: float) -> list[float]:
    from megatron.core import parallel_state as ps

    out = []
    for group in (None, ps.get_data_parallel_group(), ps.get_expert_model_parallel_group()):
        t = torch.full((4,), value, device="cuda")
        dist.all_reduce(t, group=group)
        out.append(float(t[0]))
    torch.cuda.synchronize()
    return out


def test_nccl_groups_aborted_from_another_thread_then_reformed_in_the_same_process():
    from megatron.training.initialize import shutdown
    from moe_ft.launch.worker import abort_device_communicators

    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True, timeout=timedelta(seconds=60))
    _form(store, 0)
    assert _sum_on_every_group(2.0) == [2.0, 2.0, 2.0]

    # the notice thread aborts the backends while the main thread is elsewhere
    result: dict = {}
    t0 = time.perf_counter()
    notice = threading.Thread(target=lambda: result.update(aborted=abort_device_communicators()))
    notice.start()
    notice.join(30)
    abort_s = time.perf_counter() - t0
    assert not notice.is_alive(), "aborting the NCCL communicators did not return"
    assert result["aborted"] >= 2, result  # the default group and Megatron-Core's groups that hold a communicator

    with pytest.raises(Exception):  # an aborted group fails rather than computes
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()

    t0 = time.perf_counter()
    shutdown(failed=True)  # leaves every group without waiting for their work
    leave_s = time.perf_counter() - t0
    assert not dist.is_initialized()

    t0 = time.perf_counter()
    _form(store, 1)
    sums = _sum_on_every_group(3.0)
    reform_s = time.perf_counter() - t0
    assert sums == [3.0, 3.0, 3.0]
    shutdown(failed=False)
    record("gpu_nccl_abort_reform", {"communicators_aborted": result["aborted"], "abort_s": round(abort_s, 4),
                                     "leave_s": round(leave_s, 4), "reform_and_first_collectives_s": round(reform_s, 4)})
