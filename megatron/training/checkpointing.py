"""Persisted checkpoints in Megatron ``dist_checkpointing`` format (``torch_dist`` backend).

Layout (as Megatron-LM): ``<save>/iter_0000010/`` holds the sharded model, optimizer, scheduler and
per-rank RNG state; ``<save>/latest_checkpointed_iteration.txt`` names the newest complete one and is
written (atomically, by rank 0) only after every rank finished saving and the checkpoint's metadata is
written, so a crash mid-save never makes a torn checkpoint "latest" (loading warns about and ignores any
newer, unfinished ``iter_*`` directory). The model part is the plain ``GPTModel.sharded_state_dict()``
(under ``model``, or ``model0``, ``model1``, ... per chunk with virtual pipeline stages, as Megatron-LM
keys them), so a Megatron-Core model built from the same config loads it directly.
"""

from __future__ import annotations

import logging
import os
import random

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from torch.distributed.checkpoint.api import CheckpointException

from megatron.training.checkpoint_tracker import TRACKER_FILE, CheckpointError, checkpoint_dir, latest_checkpoint
from megatron.training.collectives import all_reduce
from megatron.training.model import TrainState
from megatron.training.optimizer_state import ensure_optimizer_state
from megatron.training.resume_checks import take_flags_schedule

log = logging.getLogger("megatron.training")


def rng_state() -> dict:
    """This rank's RNG streams: Python, NumPy, torch CPU (and CUDA) and Megatron's tracker."""

    state = {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _model_keys(state: TrainState) -> list[str]:
    """Megatron-LM's keys of the model chunks: ``model``, or ``model0``, ``model1``, ... with virtual
    pipeline stages (each chunk's sharded tensors carry global layer numbers, so the keys only group them)."""
    if len(state.model) == 1:
        return ["model"]
    return [f"model{i}" for i in range(len(state.model))]


def _sharded_state_dict(state: TrainState, is_loading: bool, optimizer: bool = True) -> dict:
    """``optimizer=False``: without the optimizer's part, which is then not built either: for loading,
    Megatron-Core's distributed optimizer builds it by loading its own state back into itself, which leaves
    every parameter of an inner torch Adam one shared ``step`` tensor (each step then adds the number of
    parameters to it); :func:`_restore_adam_steps` undoes that only after a load of the optimizer state."""
    model_sd = {key: chunk.module.sharded_state_dict()
                for key, chunk in zip(_model_keys(state), state.model)}
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = {**model_sd, "rng_state": ShardedObject("rng_state", rng_state(), (world,), (rank,), replica_id=0)}
    if optimizer:
        # Megatron-LM's default layout for the distributed optimizer ('fully_sharded_model_space' needs
        # flattened ShardedTensors, which the torch_dist strategy of megatron-core 0.16 rejects).
        sharded["optimizer"] = state.optimizer.sharded_state_dict(
            model_sd.get("model", model_sd), is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    return sharded


OPTIONAL = ".optional."
"""A sharded tensor whose key has this component may be absent from a checkpoint: then it keeps its current
value (moe-ft's spare expert slots, which exist only under some replica plans)."""


def _keep_absent_optional(sharded: dict, path: str) -> None:
    """Replace the optional sharded tensors (:data:`OPTIONAL`) that the checkpoint at ``path`` lacks, model
    and optimizer state alike, by their current values (loaded as they are); optional sharded objects (e.g.
    a module's ``_extra_state``) keep theirs always."""

    present = None

    def keep(x):
        nonlocal present
        if isinstance(x, ShardedObject) and OPTIONAL in x.key:
            return LocalNonpersistentObject(x.data)
        if isinstance(x, ShardedTensor) and OPTIONAL in x.key:
            if present is None:
                present = set(dist_checkpointing.load_tensors_metadata(path))
            if x.key not in present:
                return LocalNonpersistentObject(x.data)
        return x

    dict_list_map_inplace(keep, sharded)


def _restore_adam_steps(optimizer) -> None:
    """After loading, give every param state the step its param group carries.

    Megatron's distributed optimizer keeps torch Adam's ``step`` in the param groups of its common state
    and spreads it over the param states on load, but the ``dp_reshardable`` parameter state it loads
    afterwards overwrites each ``step`` with the loading template's value (here 0). Adam's bias correction
    would then restart. Torch optimizers without the distributed optimizer carry ``step`` per param and
    have no ``step`` in their groups, so they are left as they are."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if inner is None:
            continue
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for param in group["params"]:
                if param in inner.state:
                    inner.state[param]["step"] = torch.tensor(float(group["step"]))


def checkpoint_state_dict(state: TrainState, iteration: int) -> dict:
    """What a checkpoint of ``state`` after ``iteration`` iterations holds: the sharded state plus what
    :func:`load_checkpoint` checks in another world (every writer of this format uses it, so that each of
    its checkpoints loads where a ``--save`` one does)."""
    sharded = _sharded_state_dict(state, is_loading=False)
    sharded["scheduler"] = state.scheduler.state_dict()
    sharded["iteration"] = iteration
    sharded["world_size"] = dist.get_world_size()  # the RNG state is one shard per rank of this world
    sharded["padded_vocab_size"] = padded_vocab(state)
    sharded["global_batch_size"] = state.global_batch_size  # the data position (checked at parsing on --load)
    sharded["run_id"] = state.run_id  # which run saved it: --no-load-optim/--no-load-rng skip only others'
    return sharded


def save_checkpoint(root: str, iteration: int, state: TrainState, hooks=None) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory.

    The write runs as megatron-core's save request, executed synchronously: every rank writes its shards
    (``common.pt`` and ``__<rank>_*.distcp``), a barrier, then the finalization (the global ``.metadata``
    and ``metadata.json``), and only after that rank 0 points the tracker file at the checkpoint.
    ``hooks.during_checkpoint_write(iteration)`` (``megatron.training.training.StepHooks``) runs between the
    shards and the finalization: a drill that kills a rank there leaves a torn checkpoint that the tracker
    never names.

    megatron-core collects the write results through a multiprocessing ``Manager`` queue, a server process
    that a SIGKILLed rank leaks; the entry script replaces it before the first save
    (``moe_ft.compat.activate_all``, ``moe_ft/compat/writer_queue.py``)."""
    path = checkpoint_dir(root, iteration)
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    request = dist_checkpointing.save(checkpoint_state_dict(state, iteration), path, async_sharded_save=True)
    if hooks is not None:
        request.finalize_fns.insert(0, lambda: hooks.during_checkpoint_write(iteration))
    request.execute_sync()
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, TRACKER_FILE))
    dist.barrier()
    return path


def torn_checkpoints(root: str, latest: int | None) -> list[str]:
    """Checkpoint directories under ``root`` newer than the tracker's ``latest`` (all, without a tracker):
    saves that did not finish (a crash between the first shard and the tracker update). Never loaded."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in sorted(os.listdir(root)):
        if name.startswith("iter_") and name[5:].isdigit() and (latest is None or int(name[5:]) > latest):
            out.append(name)
    return out


def padded_vocab(state: TrainState) -> int:
    """The model's padded vocabulary (Megatron pads it to --make-vocab-size-divisible-by x TP): a checkpoint
    loads into another tensor-parallel size only with the same padded size."""
    return int(state.model[0].module.vocab_size)


def saved_by_this_run(common: dict, state: TrainState) -> bool:
    """Whether the checkpoint whose common state is ``common`` was saved by this run (its ``run_id`` is
    ``state.run_id``: a restart loads its own checkpoint). Collective: one answer on every rank (the flags are
    the same in every process; were they not, no rank takes a checkpoint for its own)."""
    own = bool(state.run_id) and common.get("run_id") == state.run_id
    return bool(all_reduce(torch.tensor([int(own)]), "min").item())


def load_checkpoint(root: str, state: TrainState, *, load_optim: bool = True, load_rng: bool = True,
                    override_schedule: bool = False) -> int:
    """Load the newest complete checkpoint under ``root`` into ``state``; returns its iteration.
    Collective. Raises :class:`CheckpointError` naming the problem. ``load_optim=False``
    (``--no-load-optim``): the model, the iteration and the LR schedule, not the optimizer state;
    ``load_rng=False`` (``--no-load-rng``): not the RNG states; either only for a checkpoint another run saved
    (:func:`saved_by_this_run`); ``override_schedule``
    (``--override-opt-param-scheduler``): the LR/WD schedule of ``state.scheduler`` (the flags') from the
    checkpoint's position (``resume_checks.take_flags_schedule``), else the checkpoint's (equal to the flags' unless
    ``--use-checkpoint-opt-param-scheduler``: checked at parsing)."""
    iteration, path = latest_checkpoint(root)
    torn = torn_checkpoints(root, iteration)
    if torn and dist.get_rank() == 0:
        log.warning("ignoring %s in %s: newer than %s (iteration %d), the save did not finish",
                    ", ".join(torn), root, TRACKER_FILE, iteration)
    ensure_optimizer_state(state.optimizer)  # a fresh optimizer has no state to load into
    common = dist_checkpointing.load_common_state_dict(path)
    skipped = [flag for flag, load in (("--no-load-optim", load_optim), ("--no-load-rng", load_rng)) if not load]
    own = bool(skipped) and saved_by_this_run(common, state)
    if own:
        load_optim = load_rng = True
        if dist.get_rank() == 0:
            log.warning("%s: not applied to %s, which this run saved (a restart): its optimizer and RNG states "
                        "are loaded; the flags apply to the checkpoint a run starts from", "/".join(skipped), path)
    elif skipped and dist.get_rank() == 0:
        what = {"--no-load-optim": "optimizer state", "--no-load-rng": "RNG states"}
        log.warning("%s: loading %s without its %s (a checkpoint this run did not save)", "/".join(skipped), path,
                    " and ".join(what[flag] for flag in skipped))
    sharded = _sharded_state_dict(state, is_loading=True, optimizer=load_optim)
    if not load_rng:
        del sharded["rng_state"]
    saved_world = common.get("world_size", dist.get_world_size())
    if saved_world != dist.get_world_size() and "rng_state" in sharded:  # per-rank streams: not across sizes
        del sharded["rng_state"]
        if dist.get_rank() == 0:
            log.warning("%s was saved by %d ranks, loading on %d: the RNG state is not restored (as Megatron-LM "
                        "with a changed world size); everything else is", path, saved_world, dist.get_world_size())
    saved_vocab, vocab = common.get("padded_vocab_size"), padded_vocab(state)
    if saved_vocab is not None and saved_vocab != vocab:
        raise CheckpointError(
            f"{path} was saved with a vocabulary padded to {saved_vocab} rows, this model pads it to {vocab} (the "
            f"padding is --make-vocab-size-divisible-by x --tensor-model-parallel-size): the padded rows' logits "
            f"enter the softmax, so the loaded model would compute another loss; pass --make-vocab-size-divisible-by "
            f"so that the padded size is {saved_vocab} again (e.g. 128 x the saving run's TP over this run's TP)")
    _keep_absent_optional(sharded, path)
    try:
        loaded = dist_checkpointing.load(sharded, path)
    except (Exception, CheckpointException) as e:  # many types (torch's CheckpointException is a BaseException)
        hint = ""
        if load_optim and not own and "optimizer" in str(e):
            hint = ("; the optimizer state does not map onto this run's optimizer (e.g. saved with another "
                    "--expert-model-parallel-size): pass --no-load-optim to load the model alone")
        what = str(e) if len(str(e)) <= 600 else f"{str(e)[:600]}... ({len(str(e)) - 600} more characters)"
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {what}{hint}") from e
    with torch.no_grad():  # fp32 + distributed optimizer: main params are views of leaf parameters
        for key, chunk in zip(_model_keys(state), state.model):
            chunk.module.load_state_dict(loaded[key])
        if load_optim:
            state.optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(state.optimizer)
    flags = {k: v for k, v in state.scheduler.state_dict().items() if k != "num_steps"}  # built from the flags
    state.scheduler.load_state_dict(common["scheduler"])
    if override_schedule:  # the flags' values from the saved position, in the parameter groups too
        take_flags_schedule(state.scheduler, flags)
    if "rng_state" in loaded:
        set_rng_state(loaded["rng_state"])
    if int(common["iteration"]) != iteration:
        raise CheckpointError(f"{path} holds iteration {common['iteration']}, tracker says {iteration}")
    log.info("loaded checkpoint %s (iteration %d)", path, iteration)
    return iteration
