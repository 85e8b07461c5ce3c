"""The training loop: Megatron-Core schedules, DDP, optimizer, LR schedule, evaluation, logging, saving.

Fault tolerance plugs in through :class:`StepHooks` (``on_step_begin`` / ``on_step_end``), so the loop
does not depend on ``moe_ft``: nothing under ``megatron/training`` imports it (``tests/test_loop_independent.py``);
the entry script activates the CPU compatibility layer and the checkpoint-writer shim before the loop runs.
A train step is a function of (state, data, iteration) that recovery can replay.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache, partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe import moe_utils

from megatron.training import collectives
from megatron.training.arguments import Args
from megatron.training.data import Batch, ReplayableData
from megatron.training.model import TrainState

log = logging.getLogger("megatron.training")


@lru_cache(maxsize=8)
def causal_mask(seq_length: int, device: str = "cpu") -> torch.Tensor:
    """[1, 1, s, s] boolean mask, True where attention is *not* allowed (Megatron's convention), built once
    per length and device: every micro-batch of every step reads the same tensor (nothing built on the host
    and copied from pageable memory per micro-batch: ~1 GiB per iteration at s = 4096 and 64 micro-batches).
    Read-only: Megatron-Core's attention does not write into it."""
    return torch.triu(torch.ones(1, 1, seq_length, seq_length, dtype=torch.bool, device=device), diagonal=1)


def _to_device(batch: Batch) -> Batch:
    if not torch.cuda.is_available():
        return batch
    dev = torch.cuda.current_device()
    return Batch(**{k: getattr(batch, k).to(dev, non_blocking=True) for k in batch.__dataclass_fields__})


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch; returns (loss, {"lm loss": loss averaged over DP})."""
    losses = output_tensor.float()
    loss = torch.sum(losses.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
    reported = loss.detach().clone()
    collectives.all_reduce(reported, group=ps.get_data_parallel_group())  # device path: NCCL on a GPU cluster
    reported /= ps.get_data_parallel_world_size()
    return loss, {"lm loss": reported}


def forward_step(data_iterator, model, seq_length: int):
    """Megatron's forward_step_func contract: returns (output_tensor, loss_func)."""
    batch = _to_device(next(data_iterator))
    mask = causal_mask(seq_length, str(batch.tokens.device))
    output = model(batch.tokens, batch.position_ids, mask, labels=batch.labels)
    return output, partial(loss_func, batch.loss_mask)


@dataclass(kw_only=True)
class StepResult:
    """What one iteration produced. ``loss``/``load_balancing_loss`` are only known on the last stage
    (NaN elsewhere until :func:`share_from_last_stage`)."""

    iteration: int
    loss: float
    lr: float
    grad_norm: float
    load_balancing_loss: float
    update_successful: bool
    seconds: float
    num_zeros: float | None = None


class StepHooks:
    """Called by the loop around each iteration; the fault-tolerance runtime subclasses it.
    ``on_train_start`` receives the built state and data before the first iteration and returns the
    iteration to start from (it may restore state, e.g. after a failure); ``on_train_end`` runs after
    the last one."""

    def on_train_start(self, state, data, args, start_iteration: int) -> int:
        return start_iteration

    def on_train_end(self, report) -> None:
        return None

    def on_step_begin(self, iteration: int) -> None:
        return None

    def on_step_end(self, iteration: int, result: StepResult) -> None:
        return None

    def after_log(self, iteration: int) -> None:
        """After ``iteration``'s log line (if any) is printed: the end of the iteration in the loop."""
        return None

    def before_optimizer_step(self, iteration: int) -> None:
        """After forward/backward, right before the optimizer updates the weights: a snapshot of the
        previous iteration's state must be off the weights by now (the wait is the snapshot stall)."""
        return None

    def during_checkpoint_write(self, iteration: int) -> None:
        """Inside ``save_checkpoint`` of the ``--save`` checkpoint after ``iteration`` iterations: every
        rank's shards are on disk, the checkpoint is not finalized and the tracker file does not name it
        yet (failure drills kill a rank here)."""
        return None


def _aux_losses(num_layers: int, num_microbatches: int) -> dict[str, float]:
    """Reduce Megatron's per-layer MoE aux-loss tracker, return layer-averaged values, and clear it."""
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    if not tracker:
        return {}
    moe_utils.reduce_aux_losses_tracker_across_ranks()
    out = {name: float(entry["values"].float().sum()) / (num_layers * num_microbatches)
           for name, entry in tracker.items()}
    moe_utils.clear_aux_losses_tracker()
    return out


def train_step(state: TrainState, data: ReplayableData, iteration: int, args: Args,
               forward_only: bool = False, split_idx: int = 0, hooks: StepHooks | None = None) -> StepResult:
    """Run iteration ``iteration`` (0-based): forward/backward over its micro-batches, then the optimizer
    and scheduler steps. Deterministic given the state and the iteration number."""
    start = time.perf_counter()
    model = state.model
    if not forward_only:
        for chunk in model:
            chunk.zero_grad_buffer()
        state.optimizer.zero_grad()
    batches = data.batch_for_iteration(iteration, ps.get_data_parallel_rank(), split_idx)
    losses = get_forward_backward_func()(
        forward_step_func=partial(forward_step, seq_length=args.model.seq_length),
        # the interleaved schedule (virtual pipeline stages) takes one iterator per model chunk; each chunk
        # draws every micro-batch from its own (the first chunk reads tokens, the last one labels)
        data_iterator=[iter(batches) for _ in model] if len(model) > 1 else iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=args.model.seq_length,
        micro_batch_size=args.training.micro_batch_size,
        decoder_seq_length=args.model.seq_length,
        forward_only=forward_only,
    )
    update_successful, grad_norm, num_zeros = True, float("nan"), None
    if not forward_only:
        if hooks is not None:
            hooks.before_optimizer_step(iteration)
        update_successful, grad_norm, num_zeros = state.optimizer.step()
        if update_successful:
            state.scheduler.step(increment=args.training.global_batch_size)
    aux = _aux_losses(args.model.num_layers, len(batches)) if not forward_only else {}
    loss = float("nan")
    if ps.is_pipeline_last_stage() and losses:
        loss = float(sum(float(x["lm loss"]) for x in losses) / len(losses))
    return StepResult(
        iteration=iteration,
        loss=loss,
        lr=state.optimizer.param_groups[0]["lr"],
        grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
        load_balancing_loss=aux.get("load_balancing_loss", float("nan")),
        update_successful=bool(update_successful),
        seconds=time.perf_counter() - start,
        num_zeros=num_zeros,
    )


def share_from_last_stage(value: float) -> float:
    """Broadcast a scalar known on the last pipeline stage to every stage (for logging on rank 0). The
    pipeline group is NCCL on a GPU cluster: the scalar travels on the group's device (``collectives``)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    group = ps.get_pipeline_model_parallel_group()
    t = torch.tensor([value if ps.is_pipeline_last_stage() else 0.0], dtype=torch.float64,
                     device=collectives.device_for(group))
    collectives.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(), group=group)
    return float(t.item())


def evaluate(state: TrainState, data: ReplayableData, args: Args) -> float:
    """Average loss over ``--eval-iters`` validation iterations (forward only, no state change)."""
    for chunk in state.model:
        chunk.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(args.training.eval_iters):
            total += train_step(state, data, i, args, forward_only=True, split_idx=1).loss
    for chunk in state.model:
        chunk.train()
    moe_utils.clear_aux_losses_tracker()
    return share_from_last_stage(total / args.training.eval_iters)


@dataclass
class LoopReport:
    """Summary of a :func:`train` call."""

    first_iteration: int
    last_iteration: int
    losses: list[float] = field(default_factory=list)
    iteration_seconds: list[float] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)


def _progress(iteration: int, total: int, loss: float) -> None:
    width = 30
    done = int(width * iteration / total)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {iteration}/{total} loss {loss:.3f}")
    sys.stdout.flush()
    if iteration == total:
        sys.stdout.write("\n")


def train(state: TrainState, data: ReplayableData, args: Args, start_iteration: int = 0,
          hooks: StepHooks | None = None, save_fn=None) -> LoopReport:
    """Train from ``start_iteration`` (iterations already done) to ``--train-iters``. ``save_fn(iteration)``
    persists a checkpoint after ``iteration`` iterations."""
    hooks = hooks or StepHooks()
    t = args.training
    rank0 = dist.get_rank() == 0
    report = LoopReport(first_iteration=start_iteration, last_iteration=start_iteration)
    tokens_per_iter = t.global_batch_size * args.model.seq_length
    for chunk in state.model:
        chunk.train()
    # Megatron-Core's module-level aux-loss tracker may hold the partial sums of an iteration a failed attempt
    # of this process began (moe-ft launch trains again in-process); recovery's replay logs the next values
    moe_utils.clear_aux_losses_tracker()
    start_iteration = hooks.on_train_start(state, data, args, start_iteration)
    report.first_iteration = report.last_iteration = start_iteration
    for iteration in range(start_iteration, t.train_iters):
        hooks.on_step_begin(iteration)
        result = train_step(state, data, iteration, args, hooks=hooks)
        hooks.on_step_end(iteration, result)
        done = iteration + 1
        report.last_iteration = done
        report.iteration_seconds.append(result.seconds)
        if done % t.log_interval == 0 or done == t.train_iters or done == start_iteration + 1:
            loss = share_from_last_stage(result.loss)
            lbl = share_from_last_stage(result.load_balancing_loss)
            report.losses.append(loss)
            if rank0:
                line = (f"iteration {done:6d}/{t.train_iters} | loss {loss:.4f} | lr {result.lr:.3e} | "
                        f"grad norm {result.grad_norm:.3f} | iter time {result.seconds * 1000:.1f} ms | "
                        f"tokens/s {tokens_per_iter / result.seconds:.0f} | load balancing loss {lbl:.4f}")
                if not result.update_successful:
                    line += " | skipped (inf/nan grads)"
                print(("\n" if t.progress else "") + line, flush=True)
                if not math.isfinite(loss):
                    log.warning("loss is not finite at iteration %d", done)
        elif t.progress and rank0:
            _progress(done, t.train_iters, report.losses[-1] if report.losses else float("nan"))
        hooks.after_log(iteration)
        if t.eval_interval and done % t.eval_interval == 0:
            eval_loss = evaluate(state, data, args)
            report.eval_losses.append((done, eval_loss))
            if rank0:
                print(f"validation at iteration {done} | loss {eval_loss:.4f}", flush=True)
        if save_fn is not None and t.save_interval and done % t.save_interval == 0 and done != t.train_iters:
            save_fn(done)
    if save_fn is not None and report.last_iteration > start_iteration:
        save_fn(report.last_iteration)
    hooks.on_train_end(report)
    return report
