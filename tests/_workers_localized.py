"""Workers of the localized-recovery tests (``tests/test_upstream_log.py``; h12b's survivor-point tests).

Functions prefixed ``log_`` belong to the upstream-logging tests, ``surv_`` to the survivor-point tests.

``log_worker``: a real job of 4 gloo processes (Megatron-Core 1F1B schedule, real optimizer) trains
``num_iters`` iterations fault-free with upstream logging on (the runtime component's seams and recorder),
keeping a dense copy of every rank's full state (weights, optimizer state, scheduler, RNG) before iteration
``k``. Then, for each replaying set (a pipeline stage's ranks), every rank takes part in ``exchange_logs`` and
only the replaying ranks reset to their iteration-``k`` state and replay ``k .. num_iters-1`` under
:class:`LogReplay`; their state must equal the fault-free final state bitwise. The other ranks never call a
p2p or collective of the train step meanwhile: a replay that tried to reach them would hang and hit the
gloo timeout.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch

from tests._ft_helpers import tiny_model_flags

MODEL = tiny_model_flags(num_layers=4, ffn_hidden_size=64, seq_length=16, max_position_embeddings=16,
                         seed=1234)


def log_setup(rank: int, world: int, init: str, corpus: str, extra: list[str]):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron.training.arguments import parse_args
    from megatron.training.initialize import quiet_optional_dependency_warnings, set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from moe_ft import comm
    from moe_ft.compat import cpu as cpu_compat

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    quiet_optional_dependency_warnings()
    cpu_compat.activate()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=90))
    args = parse_args([*MODEL, *extra, "--data-path", corpus], world_size=world)
    p = args.parallel
    ps.initialize_model_parallel(pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                                 expert_model_parallel_size=p.expert_model_parallel_size)
    comm.init_coordination()
    set_seeds(args.training.seed)
    return args, build_train_state(args), build_data(args)


def log_state(state) -> dict[str, torch.Tensor]:
    """Live tensors of this rank's full state (``moe_ft.digest``: weights, optimizer, scheduler, RNG)."""
    from moe_ft.digest import local_state_tensors

    return local_state_tensors(state.model, state.optimizer, state.scheduler)


def log_save(state) -> dict:
    from copy import deepcopy

    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {"tensors": {k: v.detach().clone() for k, v in log_state(state).items()},
            "scheduler": deepcopy(state.scheduler.state_dict()), "rng": torch.get_rng_state(),
            "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}


def log_restore(state, saved: dict) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    live = log_state(state)
    with torch.no_grad():
        for name, tensor in saved["tensors"].items():
            if name.startswith(("model", "optim")):
                live[name].copy_(tensor)
    state.scheduler.num_steps = 0  # Megatron's load_state_dict steps *by* the saved count (fresh-scheduler API)
    state.scheduler.load_state_dict(saved["scheduler"])  # also sets the optimizer's lr / wd for that step
    torch.set_rng_state(saved["rng"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in saved["tracker"].items()})


def log_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes (dtype, shape, raw bytes) differ."""
    def raw(t):
        t = t.detach().contiguous().cpu()
        return t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8)

    out = [n for n in sorted(set(a) | set(b)) if n not in a or n not in b]
    for n in sorted(set(a) & set(b)):
        (da, sa, ba), (db, sb, bb) = raw(a[n]), raw(b[n])
        if da != db or sa != sb or not torch.equal(ba, bb):
            out.append(n)
    return out


def log_worker(rank: int, world: int, init: str, corpus: str, extra: list[str], store: str, out: str,
               k: int, num_iters: int, replay_sets: list[list[int]]) -> None:
    import torch.distributed as dist

    from megatron.training.training import train_step
    from moe_ft import comm
    from moe_ft.localized.component import UpstreamLogging
    from moe_ft.localized.log_replay import LogReplay, exchange_logs
    from moe_ft.localized.log_store import MissingLogEntry

    args, state, data = log_setup(rank, world, init, corpus, extra)
    logging_ = UpstreamLogging.build(store, rank)
    saved = None
    for t in range(num_iters):
        if t == k:
            saved = log_save(state)
        logging_.on_step_begin(t)
        train_step(state, data, t, args)
        logging_.on_iteration_end(t, replaying=False)
    final = log_save(state)["tensors"]
    logging_.drain()  # the writer thread publishes the iterations behind the training thread
    result = {"rank": rank, "log_bytes": logging_.recorder.bytes_per_iteration,
              "logged": logging_.log_dir.iterations(), "changed": len(log_differences(saved["tensors"], final)),
              "replays": []}
    for ranks in replay_sets:
        feed = exchange_logs(logging_.log_dir, replaying=ranks, iterations=range(k, num_iters))
        entry = {"ranks": ranks, "fetched_bytes": feed.nbytes}
        if rank in ranks:
            log_restore(state, saved)
            with LogReplay(logging_.seams, feed, replaying=ranks, rank=rank, recorder=logging_.recorder) as replay:
                for t in range(k, num_iters):
                    with replay.iteration(t):
                        train_step(state, data, t, args)
            entry["differences"] = log_differences(log_state(state), final)
            entry["sends_fed"] = sum(len(v) for v in feed.sends.values())
            entry["collectives_fed"] = sum(len(v) for v in feed.collectives.values())
        comm.barrier()
        result["replays"].append(entry)
    # a needed entry missing on a holder: every rank raises the same MissingLogEntry
    victim = replay_sets[0]
    holder = min(r for r in range(world) if r not in victim)
    if rank == holder:
        logging_.log_dir.drop_after(k - 1)  # the holder's log loses iteration k (and what follows)
    try:
        exchange_logs(logging_.log_dir, replaying=victim, iterations=range(k, num_iters))
        result["missing_error"] = ""
    except MissingLogEntry as e:
        result["missing_error"] = str(e)
    logging_.close()
    with open(out.format(rank), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
