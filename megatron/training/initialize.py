"""Process groups, seeds and determinism: everything before the model is built.

On a CPU-only torch, Megatron-Core needs a compatibility layer ("cuda" calls answered by the CPU) that the
entry script activates before calling :func:`initialize_distributed` (``pretrain_gpt_moe.py``:
``moe_ft.compat.activate_all()``); this module only checks that one is active, so the training loop does
not depend on ``moe_ft``.
"""

from __future__ import annotations

import logging
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from megatron.training import quiet
from megatron.training.arguments import Args
from megatron.training.validation import TE_NONDETERMINISTIC_ENV

log = logging.getLogger("megatron.training")


def quiet_optional_dependency_warnings(verbose: bool = False) -> None:
    """Megatron-Core's expected warnings (Transformer Engine and Apex absent, ...) are held back and summed up
    on rank 0 (``megatron/training/quiet.py``); ``verbose`` (``--verbose``) prints them instead."""
    quiet.hold()
    if verbose:
        quiet.release()


def _restart_safe_store(timeout_s: float) -> dict:
    """Under torchrun restarts (``--max-restarts``) workers share the agent's store across attempts, and
    torch 2.13's gloo then reads the previous attempt's peer addresses (``connectFullMesh ... Connection
    refused``). Key the default group's store by the run and the restart attempt (``moe-ft launch`` forms
    every run's groups in the rendezvous store: a job relaunched under a new rendezvous id starts again at
    attempt 0 there); ``{}`` outside torchrun."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return {}
    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=timeout_s))
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return {"store": dist.PrefixStore(f"/megatron/{run}/attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": world}


def init_default_group(backend: str, timeout_s: float, store: dict) -> None:
    """``init_process_group``, named as in a fresh process. torch 2.13 names groups by a process-wide
    counter (``_world.group_count``) that only ``destroy_process_group`` resets; a formation that failed in
    this process (an in-process attempt abandoned while forming its groups) leaves it at 1, and the default
    group would then be "1" here but "0" in a fresh spare: their keys in the store never meet and both
    wait out the timeout."""
    dist.distributed_c10d._world.group_count = 0
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s), **store)


def deterministic_environment(args: Args) -> None:
    """``--deterministic``: cuBLAS's deterministic workspace and, with Transformer Engine, its deterministic
    kernels (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, which Megatron-Core's TE attention requires in
    ``deterministic_mode``; a user's other value is refused at parse time). A value the user set stays."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if args.model.transformer_impl == "transformer_engine":
        os.environ.setdefault(TE_NONDETERMINISTIC_ENV, "0")


def require_cuda_or_cpu_layer() -> None:
    """Megatron-Core asks ``torch.cuda.current_device()`` for the device of every buffer it builds; on a
    CPU-only torch that raises unless a CPU compatibility layer answers it. Fail here, before any process
    group exists, with the fix instead of deep inside Megatron."""
    if torch.cuda.is_available():
        return
    try:
        torch.cuda.current_device()
    except (AssertionError, RuntimeError) as e:
        raise RuntimeError(
            f"no CUDA device ({e}) and no CPU compatibility layer active: Megatron-Core cannot run on this "
            "CPU-only process. Launch through pretrain_gpt_moe.py, or call moe_ft.compat.activate_all() "
            "before initialize_distributed()/pretrain()") from None


def initialize_distributed(args: Args, timeout_s: float | None = None, join_timeout_s: float | None = None) -> None:
    """Init the default process group (NCCL on GPU, gloo on CPU) and Megatron's model-parallel groups.
    Launched by torchrun: RANK/WORLD_SIZE/MASTER_ADDR come from the environment. Without CUDA the CPU
    compatibility layer must already be active (:func:`require_cuda_or_cpu_layer`). ``join_timeout_s``:
    how long forming the default group may wait for every rank to arrive (a ``DistStoreError`` or
    ``DistBackendError`` after it); operations then get ``timeout_s`` (default: ``--distributed-timeout-minutes``).
    ``join_timeout_s`` ``None``: ``timeout_s`` for both."""
    if timeout_s is None:
        timeout_s = 60.0 * args.training.distributed_timeout_minutes
    quiet_optional_dependency_warnings(args.training.verbose)
    require_cuda_or_cpu_layer()
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        torch.set_num_threads(args.training.num_threads)
    if args.training.deterministic:
        deterministic_environment(args)
        torch.use_deterministic_algorithms(True)
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        join = join_timeout_s if join_timeout_s is not None else timeout_s
        store = _restart_safe_store(join)
        init_default_group("nccl" if use_cuda else "gloo", join, store)
        if join != timeout_s:  # every rank arrived: operations and later groups get the full timeout
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
            if "store" in store:
                store["store"].set_timeout(timedelta(seconds=timeout_s))
    try:
        if dist.get_world_size() != args.world_size:
            raise RuntimeError(f"arguments were validated for world size {args.world_size} but the process "
                               f"group has {dist.get_world_size()} ranks")
        p = args.parallel
        ps.destroy_model_parallel()  # whatever a previous formation in this process left, even half made
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            expert_tensor_parallel_size=p.expert_tensor_parallel_size,
            distributed_timeout_minutes=max(1, round(timeout_s / 60)),
            order="tp-cp-ep-pp-dp" if p.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp",
        )
    except BaseException:
        # a peer died while the groups formed (or a stop): a process that goes on to the next attempt
        # (moe-ft launch) must find neither this default group nor half of Megatron's groups, or its next
        # formation asserts "data parallel group is already initialized" (no peer failure: it leaves)
        shutdown(failed=True)
        raise


def set_seeds(seed: int) -> None:
    """Megatron's seeding: every process seeds torch with ``seed + 100*pp_rank`` and the model-parallel RNG
    tracker (dropout, expert init) with its own offsets."""

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def forget_transformer_engine_fp8_state() -> None:
    """Reset Transformer Engine's process-wide FP8 state (``FP8GlobalStateManager``, class attributes; TE
    2.9-2.11 ``transformer_engine/pytorch/quantization.py``). With delayed scaling every TE module appends its
    amax, amax history and scale, at its first FP8 forward, to global lists keyed by the recipe and
    ``hash()`` of the amax-reduction group; every exit of an FP8 autocast region then reduces each list over
    its group and updates every module's scale and history in it. A process that trains again after leaving
    its groups (an in-process ``moe-ft launch`` attempt builds a new model and new groups) would keep the
    previous attempt's model in those lists, alive, under a key whose group it left: the next region's exit
    would reduce over that group, and a list the new model shares a key with would be longer than on a
    freshly started rank. TE's own tests reset it between models the same way."""
    try:
        # optional dependency: Transformer Engine (its FP8 path is the only one with this state)
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager
    except ImportError:
        return
    FP8GlobalStateManager.reset()


def shutdown(failed: bool = False) -> None:
    """Leave Megatron's parallel state and every process group, and forget Transformer Engine's FP8 state
    that refers to them (:func:`forget_transformer_engine_fp8_state`). ``failed``: training raised (a peer
    died, or this attempt is being left): abort the groups instead of destroying them. Destroying waits for
    the groups' pending work, which a dead peer never completes on NCCL; torch 2.13's
    ``_abort_process_group`` aborts every communicator at once (NCCL's inside one group call, so that
    their aborts cannot deadlock each other) and forgets every group, as a destroy does. On gloo the abort
    returns at once (the connections close once the groups are collected) and the same path runs."""
    forget_transformer_engine_fp8_state()
    ps.destroy_model_parallel()  # also a half-made state, which model_parallel_is_initialized() says is none
    if not dist.is_initialized():
        return
    if failed:
        dist.distributed_c10d._abort_process_group()
    else:
        dist.destroy_process_group()
