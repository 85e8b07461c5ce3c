"""Upstream logging on CUDA (``docs/localized.md``; one GPU): sends are copied into pinned host buffers
asynchronously and published only after the recorder synchronises, so a send buffer that the next kernel
overwrites right after the send is logged with the bytes it had when sent; a log-fed receive comes back on
the current CUDA device, bitwise, as a fresh ``requires_grad`` buffer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_ft.localized.collective_log import CollectiveSeam
from moe_ft.localized.log_replay import LogFeed, LogReplay, LogSeams
from moe_ft.localized.log_store import FWD, LogDir
from moe_ft.localized.upstream_log import LogRecorder, P2PSeam

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


@pytest.mark.parametrize("background", [False, True], ids=["sync", "writer-thread"])
def test_cuda_sends_logged_with_their_bytes_at_send_time_and_fed_back_on_device(tmp_path, background):
    dev = torch.device("cuda", torch.cuda.current_device())
    rec = LogRecorder(LogDir(tmp_path / "rank1"), background=background)
    rec.begin(0)
    sent = [torch.randn(256, 4, 1024, device=dev) for _ in range(4)]
    expected = [t.cpu() for t in sent]
    for t in sent:
        rec.record_send(FWD, 2, 1, t)
        t.mul_(3.0)  # the next kernel on the same stream reuses the buffer
    assert rec.end() == 4 * sent[0].numel() * 4  # background: the writer waits for an event, not a device sync
    rec.flush()
    logged = LogDir(tmp_path / "rank1").read(0, "send.fwd.to2")
    assert all(torch.equal(got, want) for (_, got), want in zip(logged, expected))

    feed = LogFeed(sends={(0, 2, "bwd", 1): [(2, expected[0])]})
    comm = SimpleNamespace(prev_rank=0, next_rank=2, pp_group=SimpleNamespace(rank=lambda: 1),
                           virtual_pipeline_model_parallel_size=None,
                           config=SimpleNamespace(pipeline_dtype=torch.float32, use_ring_exchange_p2p=False,
                                                  batch_p2p_comm=True))
    with LogReplay(LogSeams(P2PSeam(), CollectiveSeam({0: 0, 1: 1, 2: 2})), feed, replaying=[1], rank=1) as replay:
        with replay.iteration(0):
            _, got, _ = replay.communicate(comm, None, tensor_send_next=None, tensor_send_prev=None, recv_prev=False,
                                           recv_next=True, tensor_shape=tuple(expected[0].shape))
    assert got.device == dev and got.requires_grad and torch.equal(got.detach().cpu(), expected[0])
