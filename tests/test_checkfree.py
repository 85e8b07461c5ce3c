"""CheckFree / CheckFree+ building blocks (``moe_ft/checkfree``): the weighted average, the learning-rate
boost, the swap schedule and the embedding/output copies. Single process; the recorded gradient norm is
checked on the tiny model in a one-rank Megatron world."""

from __future__ import annotations

import math

import pytest
import torch

from moe_ft.checkfree import (
    CopyStore,
    LrBoost,
    LrBoostConfig,
    SwapForwardStep,
    align_layers,
    averaging_weights,
    copies_held_by,
    copy_holders,
    is_swapped,
    layer_order,
    microbatch_orders,
    rebuild_layers,
    squared_grad_norm,
    stage_layers,
    stage_order,
    swap_partner,
    swapped_microbatches,
)
from moe_ft.store.errors import CorruptEntryError
from tests._ft_helpers import tiny_model_flags


# ------------------------------------------------------------------------------------ weighted average
def _layer(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([[values[0], values[1]], [values[2], values[3]]]), "b": torch.tensor([values[0]])}


def test_weighted_average_by_hand():
    """Alg. 1 line 3 with w = ||grad||^2 taken from real gradient tensors: ||[1,1]||^2 = 2 (previous
    stage), ||[1]*6||^2 = 6 (next): weights 1/4 and 3/4, so layer k = (W_prev + 3 W_next) / 4."""
    prev = [_layer(1, 2, 3, 4), _layer(-4, 0, 8, 12)]
    nxt = [_layer(5, 6, 7, 8), _layer(4, 4, 0, 0)]
    w_prev, w_next = squared_grad_norm([torch.ones(2), None]), squared_grad_norm([torch.ones(2, 3)])
    assert (w_prev, w_next) == (2.0, 6.0)
    target = [{k: torch.zeros_like(v) for k, v in _layer(0, 0, 0, 0).items()} for _ in range(2)]
    weights = rebuild_layers(target, prev, nxt, grad_sq_prev=w_prev, grad_sq_next=w_next)
    assert (weights.prev, weights.next, weights.note) == (0.25, 0.75, "")
    assert torch.equal(target[0]["w"], torch.tensor([[4.0, 5.0], [6.0, 7.0]]))  # (1+15)/4, (2+18)/4, …
    assert torch.equal(target[0]["b"], torch.tensor([4.0]))
    assert torch.equal(target[1]["w"], torch.tensor([[2.0, 3.0], [2.0, 3.0]]))  # (-4+12)/4, (0+12)/4, (8+0)/4 …
    # the neighbour with the larger gradient (the less converged stage) pulls the rebuilt layer towards it
    flipped = [{k: torch.zeros_like(v) for k, v in _layer(0, 0, 0, 0).items()} for _ in range(2)]
    rebuild_layers(flipped, prev, nxt, grad_sq_prev=w_next, grad_sq_next=w_prev)
    assert torch.equal(flipped[0]["w"], torch.tensor([[2.0, 3.0], [4.0, 5.0]]))


def test_weighted_average_keeps_dtype_and_rounds_once():
    prev = [{"w": torch.tensor([1.0, 3.0], dtype=torch.bfloat16)}]
    nxt = [{"w": torch.tensor([2.0, 5.0], dtype=torch.bfloat16)}]
    target = [{"w": torch.zeros(2, dtype=torch.bfloat16)}]
    rebuild_layers(target, prev, nxt, grad_sq_prev=1.0, grad_sq_next=1.0)
    assert target[0]["w"].dtype == torch.bfloat16
    assert torch.equal(target[0]["w"], torch.tensor([1.5, 4.0], dtype=torch.bfloat16))


def test_zero_and_degenerate_gradient_norms():
    both_zero = averaging_weights(0.0, 0.0)
    assert (both_zero.prev, both_zero.next) == (0.5, 0.5) and "both" in both_zero.note
    one_zero = averaging_weights(0.0, 3.0)
    assert (one_zero.prev, one_zero.next) == (0.0, 1.0) and "copy" in one_zero.note
    not_finite = averaging_weights(float("inf"), 1.0)
    assert (not_finite.prev, not_finite.next) == (0.5, 0.5) and "not finite" in not_finite.note
    assert (averaging_weights(float("nan"), 1.0).prev, averaging_weights(7.0, 9.0, "uniform").prev) == (0.5, 0.5)
    assert (averaging_weights(7.0, 9.0, "copy").prev, averaging_weights(7.0, 9.0, "copy").next) == (1.0, 0.0)
    with pytest.raises(ValueError, match="negative"):
        averaging_weights(-1.0, 1.0)
    with pytest.raises(ValueError, match="unknown rebuild strategy"):
        averaging_weights(1.0, 1.0, "mean")
    # zero norms end-to-end: the rebuilt layer is the plain mean
    target = [{"w": torch.zeros(2)}]
    rebuild_layers(target, [{"w": torch.tensor([1.0, 2.0])}], [{"w": torch.tensor([3.0, 6.0])}],
                   grad_sq_prev=0.0, grad_sq_next=0.0)
    assert torch.equal(target[0]["w"], torch.tensor([2.0, 4.0]))


def test_layer_alignment_and_mismatches():
    assert align_layers(2, 2) == [0, 1]
    assert align_layers(3, 2) == [0, 0, 1]  # relative depth: floor(k * n_neighbour / n_lost)
    assert align_layers(2, 4) == [0, 2]
    with pytest.raises(ValueError, match="neighbour holding transformer layers"):
        align_layers(2, 0)
    with pytest.raises(ValueError, match="different tensors"):
        rebuild_layers([{"w": torch.zeros(1)}], [{"w": torch.ones(1)}], [{"v": torch.ones(1)}],
                       grad_sq_prev=1.0, grad_sq_next=1.0)
    with pytest.raises(ValueError, match="in the two neighbours"):
        rebuild_layers([{"w": torch.zeros(1)}], [{"w": torch.ones(1)}], [{"w": torch.ones(2)}],
                       grad_sq_prev=1.0, grad_sq_next=1.0)


class _Block(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2, bias=False) for _ in range(n))


class _Chunk(torch.nn.Module):
    """The module layout of a Megatron ``GPTModel`` chunk that the CheckFree helpers read
    (``decoder.layers.<k>.*``; ``embedding.*`` outside the layers)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(5, 2)
        self.decoder = _Block(n)

    def forward(self, x):
        for layer in self.decoder.layers:
            x = layer(x)
        return x


def test_stage_layers_lists_layer_tensors_by_position():
    chunk = _Chunk(3)
    layers = stage_layers(chunk)
    assert [sorted(layer) for layer in layers] == [["weight"]] * 3
    assert layers[1]["weight"] is chunk.decoder.layers[1].weight  # live tensors: rebuild writes into them


# ------------------------------------------------------------------------------- the recorded norm (w)
@pytest.mark.timeout(90)
def test_recorded_norm_is_over_the_transformer_layers_only(corpus, megatron_world):
    """CheckFree §4.2 weights a neighbour by ``||grad W_{s,j}||^2`` of the stage that is averaged, and in the
    paper the (de-)embedding is a stage of its own (§4.3, footnote 3). On one rank (first and last stage at
    once) after two real training steps, ``CheckFreeNorms`` records the squared norm of the
    ``decoder.layers.*`` gradients, not of the embedding, final norm and output layer too (before, the
    output layer alone was most of it)."""
    # Megatron and the runtime are imported here, not at the top: start-up time of this mostly pure module
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from megatron.training.training import train_step
    from moe_ft.checkfree.recovery import GRAD_SQ
    from moe_ft.runtime.components import CheckFreeNorms

    args = parse_args([*tiny_model_flags(seq_length=16, global_batch_size=4, train_iters=2), "--data-path", corpus],
                      world_size=1)
    set_seeds(args.training.seed)
    state = build_train_state(args)
    data = build_data(args)
    for t in range(2):
        train_step(state, data, t, args)
    layers, outside = 0.0, {}
    for name, p in state.model[0].named_parameters():
        sq = float(p.main_grad.double().pow(2).sum())
        if ".decoder.layers." in f".{name}":
            layers += sq
        else:
            outside[name.removeprefix("module.")] = sq
    assert {"embedding.word_embeddings.weight", "output_layer.weight"} <= set(outside)
    assert outside["output_layer.weight"] > layers > 0  # leaving them in would change w, by a lot
    recorded = CheckFreeNorms(state.model).snapshot_tensors()[GRAD_SQ]
    assert recorded.shape == (1,) and recorded.dtype == torch.float32
    assert math.isclose(float(recorded), layers, rel_tol=1e-5), (float(recorded), layers, outside)


# ---------------------------------------------------------------------------------------- lr boost
def _optimizer_and_scheduler(style: str):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    # the per-group keys Megatron's get_megatron_optimizer sets on every group
    opt = torch.optim.Adam([{"params": [a], "max_lr": 3e-4, "min_lr": 3e-5},
                            {"params": [b], "max_lr": 3e-4, "min_lr": 3e-5}], lr=3e-4)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=2,
                                    lr_decay_steps=20, lr_decay_style=style, start_wd=0.0, end_wd=0.0,
                                    wd_incr_steps=20, wd_incr_style="constant")
    return opt, sched


def test_lr_boost_constant_schedule_exact_and_ends():
    opt, sched = _optimizer_and_scheduler("constant")
    ref_opt, ref = _optimizer_and_scheduler("constant")
    for _ in range(3):  # past the warm-up
        sched.step(1)
        ref.step(1)
    boost = LrBoost(opt, sched, LrBoostConfig(factor=1.1, iterations=4))
    boost.start(first_iteration=3, groups=[0])
    for t in range(3, 10):
        # the lr the optimizer step of iteration t uses
        if t < 7:
            assert opt.param_groups[0]["lr"] == 3e-4 * 1.1  # bitwise: max_lr * factor
        else:
            assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 3e-4
        assert opt.param_groups[1]["lr"] == ref_opt.param_groups[1]["lr"] == 3e-4  # not rebuilt: untouched
        sched.step(1)
        ref.step(1)
        ended = boost.end_iteration(t)
        assert ended == (t == 6)  # 4 iterations: 3, 4, 5, 6
    assert not boost.active and opt.param_groups[0]["max_lr"] == 3e-4


def test_lr_boost_follows_the_decay_and_survives_a_schedule_rewind():
    opt, sched = _optimizer_and_scheduler("cosine")
    ref_opt, ref = _optimizer_and_scheduler("cosine")
    boost = LrBoost(opt, sched)  # defaults: 1.1x until the end of training (the authors' code)
    assert (boost.config.factor, boost.config.iterations) == (1.1, 0)
    boost.start(first_iteration=0)  # every group: the rebuilt stage's rank
    for t in range(15):
        for g in (0, 1):  # min + c (max - min) on scaled operands: 1.1x up to float rounding
            assert opt.param_groups[g]["lr"] == pytest.approx(1.1 * ref_opt.param_groups[g]["lr"], rel=1e-12, abs=0)
        sched.step(1)
        ref.step(1)
        assert not boost.end_iteration(t)
    assert ref_opt.param_groups[0]["lr"] < 3e-4  # the schedule did decay meanwhile
    # recovery rewinds the schedule with load_state_dict: the boost is in the groups, it stays
    state = ref.state_dict()
    sched.num_steps = 0
    sched.load_state_dict(state)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.1 * ref_opt.param_groups[0]["lr"], rel=1e-12, abs=0)
    # a second rebuild of the same stage restarts the boost but does not compound it
    boost.start(first_iteration=15)
    assert opt.param_groups[0]["max_lr"] == 3e-4 * 1.1
    boost.stop()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    with pytest.raises(ValueError, match="group 5"):
        boost.start(first_iteration=0, groups=[5])
    with pytest.raises(ValueError, match="positive"):
        LrBoostConfig(factor=0.0)


def test_boost_outlives_a_restart_through_the_group_lr_record():
    from moe_ft.checkfree.lr_boost import GROUP_LR, capture_group_lr, restore_group_lr

    opt, sched = _optimizer_and_scheduler("cosine")
    for _ in range(4):
        sched.step(1)
    LrBoost(opt, sched).start(first_iteration=4)
    recorded = {GROUP_LR: capture_group_lr(opt)}  # with the snapshot of iteration 3
    state = sched.state_dict()
    # the restarted process: parameter groups from the flags (1x), schedule rewound by recovery
    new_opt, new_sched = _optimizer_and_scheduler("cosine")
    new_sched.num_steps = 0
    new_sched.load_state_dict(state)
    assert new_opt.param_groups[0]["lr"] != opt.param_groups[0]["lr"]  # without the record: the boost is lost
    assert restore_group_lr(recorded, new_opt, new_sched)
    for new, old in zip(new_opt.param_groups, opt.param_groups):
        assert (new["max_lr"], new["min_lr"], new["lr"]) == (old["max_lr"], old["min_lr"], old["lr"])  # bitwise
    for _ in range(3):  # and the schedule goes on identically
        sched.step(1)
        new_sched.step(1)
        assert [g["lr"] for g in new_opt.param_groups] == [g["lr"] for g in opt.param_groups]
    assert not restore_group_lr({}, new_opt, new_sched)  # metadata without a record: nothing changes
    assert not restore_group_lr({GROUP_LR: recorded[GROUP_LR][:1]}, new_opt, new_sched)  # another layout


# ----------------------------------------------------------------------------------- swap schedule
def test_swap_schedule_half_the_microbatches_deterministic():
    assert swapped_microbatches(8) == [1, 3, 5, 7]
    assert swapped_microbatches(5) == [1, 3]  # floor(M / 2) of an odd M
    assert swapped_microbatches(1) == []
    assert all(is_swapped(m) == (m % 2 == 1) for m in range(9))
    assert stage_order(4, False) == (0, 1, 2, 3)
    assert stage_order(4, True) == (1, 0, 3, 2)
    assert stage_order(6, True) == (1, 0, 2, 3, 5, 4)  # middle stages keep their place
    assert microbatch_orders(6, 4) == [(0, 1, 2, 3, 4, 5), (1, 0, 2, 3, 5, 4)] * 2
    assert [swap_partner(s, 6) for s in range(6)] == [1, 0, None, None, 5, 4]
    assert layer_order(4, 2, True) == [2, 3, 0, 1, 6, 7, 4, 5]
    for bad in (2, 3):
        with pytest.raises(ValueError, match=">= 4 pipeline stages"):
            stage_order(bad, True)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        swapped_microbatches(0)


def test_swap_forward_step_runs_the_swapped_block_order():
    torch.manual_seed(0)
    chunk = _Chunk(4)  # 4 stages of 1 layer
    x = torch.randn(3, 2)

    def forward_step(data_iterator, model):
        return model(next(data_iterator))

    step = SwapForwardStep(forward_step, num_stages=4, layers_per_stage=1)
    step.new_iteration()
    outs = [step(iter([x]), chunk) for _ in range(4)]
    layers = list(chunk.decoder.layers)
    assert step.orders_run == microbatch_orders(4, 4)
    assert list(chunk.decoder.layers) == layers  # the original order is back
    normal = layers[3](layers[2](layers[1](layers[0](x))))
    swapped = layers[2](layers[3](layers[0](layers[1](x))))
    assert torch.equal(outs[0], normal) and torch.equal(outs[2], normal)
    assert torch.equal(outs[1], swapped) and torch.equal(outs[3], swapped)
    assert not torch.equal(normal, swapped)
    outs[1].sum().backward()  # autograd recorded the order actually run
    assert all(layer.weight.grad is not None for layer in layers)
    with pytest.raises(ValueError, match="not 4 stages x 2"):
        SwapForwardStep(forward_step, num_stages=4, layers_per_stage=2)(iter([x]), chunk)


# ------------------------------------------------------------------------------- embedding copies
def test_copy_holders():
    assert copy_holders(4) == {"embedding": (0, 1), "output": (3, 2)}
    assert copies_held_by(1, 4) == ["embedding"] and copies_held_by(2, 4) == ["output"]
    assert copies_held_by(0, 2) == ["output"] and copies_held_by(1, 2) == ["embedding"]
    with pytest.raises(ValueError, match="no neighbouring stage|has none"):
        copy_holders(1)


def test_copies_refresh_and_restore_bitwise(tmp_path):
    torch.manual_seed(1)
    live = {"embedding.word_embeddings.weight": torch.randn(7, 4),
            "embedding.position_embeddings.weight": torch.randn(5, 4).to(torch.bfloat16)}
    store = CopyStore(tmp_path / "checkfree")
    versions = {}
    for it in range(3, 6):  # refreshed after every optimizer step
        with torch.no_grad():
            for t in live.values():
                t.add_(torch.randn(t.shape).to(t.dtype))
        store.refresh("embedding", it, live)
        versions[it] = {k: v.clone() for k, v in live.items()}
    assert store.iterations("embedding") == [3, 4, 5]
    store.refresh("embedding", 5, live)  # a re-run iteration replaces its copy
    assert store.iterations("embedding") == [3, 4, 5]
    for t in live.values():
        t.fill_(float("nan"))  # the owner's stage is lost
    assert store.restore("embedding", 4, live) == 7 * 4 * 4 + 5 * 4 * 2
    for name, t in live.items():
        assert t.dtype == versions[4][name].dtype
        assert torch.equal(t.view(torch.uint8), versions[4][name].view(torch.uint8))  # bit for bit
    store.prune(keep_from=5)
    assert store.iterations("embedding") == [5]
    store.discard_after(4)
    assert store.iterations("embedding") == []
    with pytest.raises(KeyError, match="no embedding copy of iteration 4"):
        store.load("embedding", 4)


def test_copy_corruption_and_mismatch_are_refused(tmp_path):
    store = CopyStore(tmp_path)
    path = store.refresh("output", 2, {"output_layer.weight": torch.arange(12.0).view(3, 4)})
    with pytest.raises(ValueError, match="the stage expects"):
        store.restore("output", 2, {"other": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match="stored"):
        store.restore("output", 2, {"output_layer.weight": torch.zeros(4, 3)})
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptEntryError):
        store.load("output", 2)
    with pytest.raises(ValueError, match="only"):
        store.refresh("dense", 2, {"x": torch.zeros(1)})
    assert math.isfinite(squared_grad_norm([]))
