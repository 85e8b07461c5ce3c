"""The communication rule on a real NCCL group (``docs/communication.md``; one GPU).

The premise: NCCL rejects a host tensor — the raw call our code used to make. ``moe_ft.comm``'s host path
runs over the coordination gloo group and its device path moves a host tensor to the group's device and the
result back; the collective checker, fed real CUDA tensors, passes raw device-tensor calls on NCCL and the
comm paths, and still fails the host tensor.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from moe_ft import comm
from moe_ft.testing.collective_checker import OUR_PATHS, CollectiveChecker

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]
HERE = os.path.abspath(__file__)


@pytest.fixture
def nccl_world():
    """A one-rank NCCL default group created under the checker (this file counts as our code)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    chk = CollectiveChecker(our_paths=(*OUR_PATHS, HERE)).install()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60),
                            device_id=torch.device("cuda", 0))
    try:
        yield chk
    finally:
        dist.destroy_process_group()
        chk.uninstall()


def test_nccl_rejects_host_tensors_and_comm_routes_them(nccl_world):
    chk = nccl_world
    assert comm.device_for(None) == torch.device("cuda", 0)
    with pytest.raises(Exception):  # the bug the rule removes: a host tensor on NCCL
        dist.all_reduce(torch.ones(1))
    assert chk.records[-1].violation.startswith("host tensor meets accelerator group")
    chk.records.clear()

    assert comm.device_for(comm.coordination_group()) == torch.device("cpu")
    assert comm.max_over_ranks(5) == 5 and comm.all_gather_object({"r": 0}) == [{"r": 0}]
    host = torch.tensor([2.0], dtype=torch.float64)
    assert comm.broadcast(host, src=0).device.type == "cpu" and float(comm.all_reduce(host)) == 2.0
    out = torch.empty(1, dtype=torch.float64)
    comm.all_gather_into_tensor(out, host)
    on_gpu = torch.ones(3, device="cuda")
    comm.all_reduce_world(on_gpu)
    dist.all_reduce(on_gpu)  # a raw call with a device tensor on NCCL is fine
    torch.cuda.synchronize()
    chk.assert_clean()
    assert {(r.fn, r.kind, r.devices[0] if r.devices else "") for r in chk.records} >= {
        ("all_reduce", "host", "cpu"), ("broadcast", "accelerator", "cuda:0"), ("all_reduce", "accelerator", "cuda:0"),
        ("all_gather_into_tensor", "accelerator", "cuda:0")}
