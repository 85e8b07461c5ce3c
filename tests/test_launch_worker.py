"""A worker of ``moe-ft launch`` between two attempts (``pretrain_gpt_moe.main``): a real process whose
training stack is stubbed (the attempt fails with a peer's error at once), stopped with a real SIGTERM in
each window where it holds its survivor point outside an attempt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests._ft_helpers import ROOT

_WORKER = r"""
import sys, time, types
sys.path.insert(0, sys.argv[1])
window = sys.argv[2]


def stub(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


parses = []


def parse_args(*args, **kwargs):
    parses.append(1)
    if window == "parse" and len(parses) > 1:  # the flags parsed again for the next attempt
        print("WINDOW", flush=True)
        time.sleep(30)
    return types.SimpleNamespace()


def pretrain(*args, **kwargs):
    raise RuntimeError("[gloo] Connection closed by peer")


stub("megatron.training.quiet", hold=lambda: None)
stub("megatron.training.deferred_compile", import_megatron_core=lambda: None)
stub("megatron.training.arguments", ArgumentError=type("ArgumentError", (Exception,), {}), parse_args=parse_args)
stub("megatron.training.pretrain", pretrain=pretrain)
stub("moe_ft.compat", activate_all=lambda: None)

import pretrain_gpt_moe
import moe_ft.launch.worker as worker
from moe_ft.elastic import standby


class Held:
    rank = 1

    def spill(self):
        print("SPILLED", flush=True)
        return types.SimpleNamespace(iteration=7, nbytes=1, seconds=0.0)


class Hooks:
    survivor = None

    def survivor_point(self):
        return Held()

    def abandon(self):
        if window == "abandon":  # closing the failed attempt
            print("WINDOW", flush=True)
            time.sleep(1)
            print("ABANDONED", flush=True)


class Member:
    inprocess, reforming, gave_up, resized, rank = True, False, False, False, 1

    def suspect(self):
        pass

    def rejoin(self, error, from_peer):
        return True


standby.enter = lambda args, membership: None
pretrain_gpt_moe.step_hooks = lambda args, membership=None, carried=None: Hooks()
worker.join = Member
worker.sever_peer_connections = lambda devices=True: 0
sys.exit(pretrain_gpt_moe.main([]))
"""


@pytest.mark.parametrize("window", ["abandon", "parse"])
def test_a_sigterm_between_attempts_writes_the_held_point_and_leaves(window):
    """SIGTERM while the survivor closes its failed attempt (the stop waits for the close), and while it
    parses its flags again after a rejoin: it writes the point it holds and exits 1. Before, ``run_guarded``
    had put the default action back when the attempt ended: the process died -15 and its point was lost."""
    proc = subprocess.Popen([sys.executable, "-c", _WORKER, ROOT, window], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout is not None
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            if line.startswith("WINDOW"):
                time.sleep(0.2)
                proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    text = "".join(out)
    assert "WINDOW" in text, text
    assert rc == 1 and "leaves: stopped by signal SIGTERM" in text and "SPILLED" in text, text
    if window == "abandon":  # the close ran to its end before the spill
        assert text.index("ABANDONED") < text.index("SPILLED"), text


def test_a_formation_that_fails_halfway_leaves_nothing_for_the_next_attempt(monkeypatch):
    """One rank, the CPU layer: Megatron's parallel state fails once its data-parallel group exists (a peer
    died while the groups formed). The default group and the groups made so far are gone, so that the
    process forms the next attempt's in the same process. Before, both stayed and the next formation
    asserted "data parallel group is already initialized" (not a peer's failure: the survivor left)."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron.training.initialize import initialize_distributed, shutdown
    from moe_ft.compat import cpu as cpu_compat

    cpu_compat.activate()
    args = SimpleNamespace(world_size=1, training=SimpleNamespace(distributed_timeout_minutes=1, verbose=False,
                                                                  num_threads=1, deterministic=False),
                           parallel=SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                    expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                                                    use_tp_pp_dp_mapping=False))
    create_group = ps.create_group

    def dies_once_data_parallel_exists(*a, **k):  # the groups after it are never made
        if ps._DATA_PARALLEL_GROUP is not None:
            raise RuntimeError("[gloo] Connection closed by peer")
        return create_group(*a, **k)

    def default_group():  # the attempt's default group, as the launcher's store forms it
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30))

    threads = torch.get_num_threads()
    try:
        default_group()
        monkeypatch.setattr(ps, "create_group", dies_once_data_parallel_exists)
        with pytest.raises(RuntimeError, match="closed by peer"):
            initialize_distributed(args)
        assert not dist.is_initialized() and ps._DATA_PARALLEL_GROUP is None
        monkeypatch.setattr(ps, "create_group", create_group)
        default_group()  # the next attempt
        initialize_distributed(args)
        assert ps.model_parallel_is_initialized()
    finally:
        shutdown()
        torch.set_num_threads(threads)
