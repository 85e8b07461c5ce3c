"""The CheckFree convergence study (CheckFree Fig. 2 / §5.2 on CPU): how training continues after
a pipeline stage is lost every N iterations, per recovery strategy.

Emulated pipeline (stated in ``docs/checkfree.md``): one process trains a Megatron-Core MoE ``GPTModel``
(pipeline size 1) whose ``num_stages x layers_per_stage`` transformer layers are cut into contiguous
blocks, block ``s`` playing pipeline stage ``s`` (stage 0 also owns the embedding, the last stage the final
norm and output layer, as in Megatron's layout). Losing stage ``s`` loses its layers' weights *and* their
Adam state (``exp_avg``, ``exp_avg_sq``, ``step``), exactly what a dead stage rank takes with it. The
optimizer is Megatron's (``get_megatron_optimizer``) with one parameter group per stage, made at its
``config_overrides`` seam, so that the 1.1x boost (``lr_boost.py``) applies to the rebuilt stage only.

Strategies (same model init, same data order, same failure schedule):

* ``none``       no failure (reference)
* ``rollback``   every stage back to the last checkpoint (taken every ``checkpoint_every`` iterations,
                 weights + optimizer + schedule), the lost iterations run again
* ``random``     the lost stage re-initialised with the model's own init methods, + lr boost
* ``copy``       the previous stage's layers, + lr boost
* ``uniform``    the plain average of both neighbours, + lr boost
* ``weighted``   CheckFree: the average weighted by the neighbours' last squared gradient norms + boost
* ``weighted-norm`` the same weighted by the plain (not squared) norms, as the authors' code does
* ``checkfree+`` out-of-order micro-batches (``swap.py``); a stage with a swap partner is rebuilt by
                 copying it, the others as ``weighted``; the embedding/output layer from the copies kept
                 on the neighbouring stage (``copies.py``); failures also hit the first and last stage
* ``swap-only``  out-of-order micro-batches without failures (the cost of swapping, CheckFree Fig. 5b)

The x axis is *executed* iterations (compute spent), as in the paper's wall-clock comparison: a rollback
spends iterations re-executing. Everything is seeded: two runs give identical curves.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from functools import partial

import torch

from moe_ft.checkfree.average import rebuild_layers, squared_grad_norm, stage_layers
from moe_ft.checkfree.copies import CopyStore
from moe_ft.checkfree.lr_boost import LrBoost, LrBoostConfig
from moe_ft.checkfree.swap import SwapForwardStep, swap_partner

STRATEGIES = ("none", "rollback", "random", "copy", "uniform", "weighted", "weighted-norm", "checkfree+", "swap-only")


@dataclass(kw_only=True)
class StudyConfig:
    iterations: int = 160
    """Executed iterations per strategy (the compute budget)."""
    fail_every: int = 20
    """A stage is lost before every ``fail_every``-th executed iteration."""
    checkpoint_every: int = 8
    """``rollback``: iterations between checkpoints."""
    num_stages: int = 4
    layers_per_stage: int = 2
    hidden_size: int = 64
    num_experts: int = 4
    seq_length: int = 64
    micro_batch_size: int = 8
    num_microbatches: int = 2
    lr: float = 3e-3
    seed: int = 1234
    eval_iters: int = 8
    strategies: tuple[str, ...] = STRATEGIES

    def __post_init__(self) -> None:
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad:
            raise ValueError(f"unknown strategies {bad}; choose from {STRATEGIES}")
        if self.fail_every < 2 or self.checkpoint_every < 1:
            raise ValueError("fail_every must be >= 2 and checkpoint_every >= 1")

    def failed_stage(self, k: int, strategy: str) -> int:
        """The stage lost at the ``k``-th failure: intermediate stages in turn (the paper's Fig. 2 setting);
        with ``checkfree+`` the first and last stage too."""
        cycle = [1, 2, 0, self.num_stages - 1] if strategy == "checkfree+" else list(range(1, self.num_stages - 1))
        return cycle[k % len(cycle)]


@dataclass
class Curve:
    strategy: str
    executed: list[int] = field(default_factory=list)
    data_iteration: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    failures: list[tuple[int, int, str]] = field(default_factory=list)
    """``(executed iteration, stage, note)`` of every loss."""
    eval_loss: float = float("nan")


class Trainer:
    """One strategy's run on the emulated pipeline (one process, gloo world of 1)."""

    def __init__(self, cfg: StudyConfig, args, strategy: str) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer.optimizer_config import ParamKey

        from megatron.training.initialize import set_seeds
        from megatron.training.model import build_train_state
        from megatron.training.pretrain import build_data
        from megatron.training.training import forward_step

        self.cfg, self.args, self.strategy = cfg, args, strategy
        set_seeds(cfg.seed)
        state = build_train_state(args)  # Megatron's model, DDP, scheduler; optimizer rebuilt per stage below
        lps = cfg.layers_per_stage
        overrides = {ParamKey(name=tuple(f"*decoder.layers.{s * lps + k}.*" for k in range(lps))): {"checkfree_stage": s}
                     for s in range(cfg.num_stages)}
        t = args.training
        opt_cfg = OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=0.0, adam_beta1=0.9,
                                  adam_beta2=0.999, clip_grad=t.clip_grad, params_dtype=torch.float32)
        state.optimizer = get_megatron_optimizer(opt_cfg, state.model, config_overrides=overrides)
        state.scheduler.optimizer = state.optimizer
        state.scheduler.step(0)  # the new groups' learning rates
        state.config.grad_scale_func = state.optimizer.scale_loss
        from megatron.training.optimizer_state import ensure_optimizer_state

        ensure_optimizer_state(state.optimizer)
        self.state, self.data = state, build_data(args)
        self.gpt = state.model[0].module
        self.layers = stage_layers(self.gpt)
        self.forward = partial(forward_step, seq_length=args.model.seq_length)
        swap = strategy in ("checkfree+", "swap-only")
        self.fstep = SwapForwardStep(self.forward, num_stages=cfg.num_stages, layers_per_stage=lps) if swap else None
        self.boost = LrBoost(state.optimizer, state.scheduler, LrBoostConfig())
        self.grad_sq = [0.0] * cfg.num_stages
        self._copies_dir = tempfile.mkdtemp(prefix="checkfree-copies-")
        self.copies = CopyStore(self._copies_dir) if strategy == "checkfree+" else None

    # ------------------------------------------------------------------------------------ pieces
    def stage_layer_tensors(self, stage: int) -> list[dict[str, torch.Tensor]]:
        lps = self.cfg.layers_per_stage
        return self.layers[stage * lps:(stage + 1) * lps]

    def stage_groups(self, stage: int) -> list[int]:
        return [i for i, g in enumerate(self.state.optimizer.param_groups) if g.get("checkfree_stage") == stage]

    def operator_tensors(self, kind: str) -> dict[str, torch.Tensor]:
        prefixes = ("embedding.",) if kind == "embedding" else ("decoder.final_layernorm.", "output_layer.")
        return {n: p for n, p in self.gpt.named_parameters() if n.startswith(prefixes)}

    def step(self, iteration: int) -> float:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        st, t = self.state, self.args.training
        for chunk in st.model:
            chunk.zero_grad_buffer()
        st.optimizer.zero_grad()
        batches = self.data.batch_for_iteration(iteration, 0, 0)
        if self.fstep is not None:
            self.fstep.new_iteration()
        losses = get_forward_backward_func()(
            forward_step_func=self.fstep or self.forward, data_iterator=iter(batches), model=st.model,
            num_microbatches=len(batches), seq_length=self.args.model.seq_length,
            micro_batch_size=t.micro_batch_size, decoder_seq_length=self.args.model.seq_length, forward_only=False)
        # CheckFree's w: each stage's squared gradient norm (DDP's reduced main_grad, before clipping)
        self.grad_sq = [squared_grad_norm(getattr(p, "main_grad", p.grad) for layer in self.stage_layer_tensors(s)
                                          for p in layer.values() if isinstance(p, torch.nn.Parameter))
                        for s in range(self.cfg.num_stages)]
        st.optimizer.step()
        st.scheduler.step(increment=t.global_batch_size)
        if self.copies is not None:  # refreshed after every optimizer step (copies.py)
            for kind in ("embedding", "output"):
                self.copies.refresh(kind, iteration, self.operator_tensors(kind))
                self.copies.prune(keep_from=iteration)
        return float(sum(float(x["lm loss"]) for x in losses) / len(losses))

    def evaluate(self) -> float:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for chunk in self.state.model:
            chunk.eval()
        total = 0.0
        with torch.no_grad():
            for i in range(self.cfg.eval_iters):
                batches = self.data.batch_for_iteration(i, 0, 1)
                out = get_forward_backward_func()(
                    forward_step_func=self.forward, data_iterator=iter(batches), model=self.state.model,
                    num_microbatches=len(batches), seq_length=self.args.model.seq_length,
                    micro_batch_size=self.args.training.micro_batch_size,
                    decoder_seq_length=self.args.model.seq_length, forward_only=True)
                total += sum(float(x["lm loss"]) for x in out) / len(out)
        for chunk in self.state.model:
            chunk.train()
        return total / self.cfg.eval_iters

    def lose_stage(self, stage: int, k: int, last_iteration: int) -> str:
        """Stage ``stage`` dies: rebuild its layers by the strategy, reset their Adam state, boost its lr."""
        from moe_ft.state.optimizer_views import main_states

        n, target = self.cfg.num_stages, self.stage_layer_tensors(stage)
        prev = self.stage_layer_tensors(stage - 1) if stage > 0 else None
        nxt = self.stage_layer_tensors(stage + 1) if stage < n - 1 else None
        with torch.no_grad():
            for layer in target:  # what the dead rank held is gone
                for tensor in layer.values():
                    tensor.fill_(float("nan"))
        if self.strategy == "random":
            self._reinit(target, seed=self.cfg.seed + 7919 * (k + 1))
            note = "random init"
        elif self.strategy == "checkfree+" and swap_partner(stage, n) is not None:
            partner = self.stage_layer_tensors(swap_partner(stage, n))
            rebuild_layers(target, partner, partner, grad_sq_prev=1.0, grad_sq_next=1.0, strategy="copy")
            note = f"copy of swap partner {swap_partner(stage, n)}"
        else:
            strategy = "uniform" if self.strategy == "uniform" else "copy" if self.strategy == "copy" else "weighted"
            if prev is None or nxt is None:  # one neighbour only: all an average can do is copy it
                prev = nxt = prev or nxt
                strategy = "copy"
            power = 0.5 if self.strategy == "weighted-norm" else 1.0
            w = rebuild_layers(target, prev, nxt, grad_sq_prev=self.grad_sq[stage - 1] ** power if stage > 0 else 0.0,
                               grad_sq_next=self.grad_sq[stage + 1] ** power if stage < n - 1 else 0.0,
                               strategy=strategy)
            note = f"{strategy} {w.prev:.2f}/{w.next:.2f}" + (f" ({w.note})" if w.note else "")
        if self.copies is not None:
            kinds = ["embedding"] * (stage == 0) + ["output"] * (stage == n - 1)
            for kind in kinds:
                live = self.operator_tensors(kind)
                with torch.no_grad():
                    for tensor in live.values():
                        tensor.fill_(float("nan"))
                self.copies.restore(kind, last_iteration, live)
                note += f", {kind} from its copy"
        lost = {id(p) for layer in target for p in layer.values()}
        for param_id, (_, main) in main_states(self.state.optimizer).items():
            if param_id in lost:
                for value in main.state.values():
                    value.zero_()  # fresh Adam moments and step count, like the authors' new optimizer
        self.state.optimizer.reload_model_params()
        self.boost.start(first_iteration=last_iteration + 1, groups=self.stage_groups(stage))
        return note

    def _reinit(self, target, seed: int) -> None:
        cfg = self.state.config
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(seed)
            for layer in target:
                for name, tensor in layer.items():
                    if "layernorm" in name or "norm." in name:
                        tensor.fill_(1.0 if name.endswith("weight") else 0.0)
                    elif tensor.dim() < 2:
                        tensor.zero_()
                    elif "linear_proj" in name or "linear_fc2" in name:
                        cfg.output_layer_init_method(tensor)  # Megatron's scaled init of residual outputs
                    else:
                        cfg.init_method(tensor)

    # -------------------------------------------------------------------------------------- run
    def run(self) -> Curve:
        cfg, curve = self.cfg, Curve(self.strategy)
        fails = self.strategy not in ("none", "swap-only")
        checkpoint, data_it = None, 0
        for executed in range(cfg.iterations):
            if fails and executed and executed % cfg.fail_every == 0:
                k = len(curve.failures)
                stage = cfg.failed_stage(k, self.strategy)
                if self.strategy == "rollback":
                    data_it = self._restore(checkpoint) if checkpoint else self._restart()
                    note = f"rolled back to iteration {data_it}"
                else:
                    note = self.lose_stage(stage, k, data_it - 1)
                curve.failures.append((executed, stage, note))
            loss = self.step(data_it)
            curve.executed.append(executed)
            curve.data_iteration.append(data_it)
            curve.loss.append(loss)
            data_it += 1
            if self.strategy == "rollback" and data_it % cfg.checkpoint_every == 0:
                checkpoint = self._capture(data_it)
        curve.eval_loss = self.evaluate()
        return curve

    def _capture(self, data_it: int) -> dict:
        from moe_ft.state.optimizer_views import main_states

        params = {id(p): p.detach().clone() for p in self.gpt.parameters()}
        opt = {pid: {k: v.clone() for k, v in m.state.items()} for pid, (_, m) in main_states(self.state.optimizer).items()}
        return {"it": data_it, "params": params, "opt": opt, "sched": self.state.scheduler.state_dict()}

    def _restore(self, ck: dict) -> int:
        from moe_ft.state.optimizer_views import main_states

        with torch.no_grad():
            for p in self.gpt.parameters():
                p.copy_(ck["params"][id(p)])
            for pid, (_, m) in main_states(self.state.optimizer).items():
                for k, v in m.state.items():
                    v.copy_(ck["opt"][pid][k])
        self.state.optimizer.reload_model_params()
        self.state.scheduler.num_steps = 0  # load_state_dict adds the stored step count
        self.state.scheduler.load_state_dict(ck["sched"])
        return ck["it"]

    def _restart(self) -> int:
        raise RuntimeError("rollback before the first checkpoint: set checkpoint_every < fail_every")

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._copies_dir, ignore_errors=True)


def study_args(cfg: StudyConfig, data_path: str):
    from megatron.training.arguments import parse_args

    n = cfg.num_stages * cfg.layers_per_stage
    return parse_args(["--num-layers", str(n), "--hidden-size", str(cfg.hidden_size), "--num-attention-heads", "4",
                       "--seq-length", str(cfg.seq_length), "--max-position-embeddings", str(cfg.seq_length),
                       "--num-experts", str(cfg.num_experts), "--moe-router-topk", "2",
                       "--micro-batch-size", str(cfg.micro_batch_size),
                       "--global-batch-size", str(cfg.micro_batch_size * cfg.num_microbatches),
                       "--train-iters", str(cfg.iterations), "--lr", str(cfg.lr), "--min-lr", str(cfg.lr / 10),
                       "--lr-warmup-iters", "10", "--lr-decay-style", "cosine", "--lr-decay-iters", str(cfg.iterations),
                       "--seed", str(cfg.seed), "--data-path", data_path], world_size=1)


def run_study(cfg: StudyConfig, data_path: str, log=print) -> list[Curve]:
    """Every strategy of ``cfg`` on a fresh, identically seeded model (one process; initialises and tears
    down a gloo world of 1 and Megatron's parallel state)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron.training.initialize import quiet_optional_dependency_warnings
    from moe_ft.compat import cpu as cpu_compat

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    quiet_optional_dependency_warnings()
    cpu_compat.activate()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel()
    curves = []
    try:
        args = study_args(cfg, data_path)
        for strategy in cfg.strategies:
            trainer = Trainer(cfg, args, strategy)
            try:
                curves.append(trainer.run())
            finally:
                trainer.close()
            c = curves[-1]
            log(f"{strategy:>10}: final train loss {sum(c.loss[-10:]) / 10:.4f} | eval loss {c.eval_loss:.4f} | "
                f"data iterations reached {c.data_iteration[-1] + 1} | failures {len(c.failures)}")
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return curves
