import random

import pytest
import torch

from moe_ft.popularity import ExpertPopularity, PopularityConfig, normalized_hhi
from moe_ft.state.operators import OperatorId


def _routing_map(rng: torch.Generator, num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    scores = torch.rand(num_tokens, num_experts, generator=rng)
    idx = scores.topk(top_k, dim=1).indices
    return torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter_(1, idx, True)


def test_hard_soft_ema_since_full_match_direct_computation():
    rng = torch.Generator().manual_seed(0)
    layers, num_experts, alpha = [1, 3], 6, 0.8
    pop = ExpertPopularity(PopularityConfig(moe_layers=layers, num_experts=num_experts, ema_alpha=alpha))
    hard = torch.zeros(2, num_experts, dtype=torch.float64)
    soft = torch.zeros_like(hard)
    ema = torch.zeros_like(hard)
    since = torch.zeros_like(hard)
    for it in range(5):
        step = torch.zeros_like(hard)
        for _micro in range(3):
            for row, layer in enumerate(layers):
                rmap = _routing_map(rng, 7, num_experts, 2)
                probs = torch.softmax(torch.randn(7, num_experts, generator=rng), dim=1)
                pop.record(layer, rmap, probs)
                step[row] += rmap.double().sum(0)
                soft[row] += probs.double().sum(0)
        pop.end_iteration(it)
        hard += step
        since += step
        ema = alpha * ema + (1 - alpha) * step
        if it == 2:
            pop.mark_full(it, [OperatorId.expert_op(3, 4), OperatorId.dense(1)])
            since[1, 4] = 0
        assert torch.equal(pop.hard, hard)
        assert torch.allclose(pop.soft, soft)
        assert torch.allclose(pop.ema, ema)
        assert torch.equal(pop.since_full, since)
        assert torch.equal(pop.last_counts, step)
    assert pop.last_full_iteration[1, 4] == 2 and pop.last_full_iteration[0, 0] == -1
    assert pop.value(OperatorId.expert_op(1, 2)) == float(hard[0, 2])
    # every token goes to exactly top_k experts
    assert pop.hard.sum() == 5 * 3 * 2 * 7 * 2


def test_counts_vector_and_missing_probs_give_soft_equal_hard():
    pop = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=3))
    pop.record(0, torch.tensor([4, 0, 2]))
    pop.end_iteration(0)
    assert pop.hard.tolist() == [[4.0, 0.0, 2.0]] and pop.soft.tolist() == [[4.0, 0.0, 2.0]]


def test_all_reduce_is_applied_to_iteration_counts_only():
    calls = []

    def fake_all_reduce(t: torch.Tensor) -> None:  # two identical ranks
        calls.append(t.shape)
        t.mul_(2)

    pop = ExpertPopularity(PopularityConfig(moe_layers=[0, 1], num_experts=2), all_reduce=fake_all_reduce)
    pop.record(1, torch.tensor([1, 3]))
    pop.end_iteration(0)
    pop.record(1, torch.tensor([1, 0]))
    pop.end_iteration(1)
    assert calls == [torch.Size([2, 2, 2])] * 2
    assert pop.hard.tolist() == [[0.0, 0.0], [4.0, 6.0]]


def test_bad_inputs_raise_actionable_errors():
    pop = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=3))
    with pytest.raises(ValueError, match="not an MoE layer"):
        pop.record(5, torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="routing map"):
        pop.record(0, torch.ones(4, 2))
    with pytest.raises(ValueError, match="unknown popularity source"):
        pop.counter("tokens")
    pop.end_iteration(3)
    with pytest.raises(ValueError, match="load_state_dict"):
        pop.end_iteration(3)
    with pytest.raises(ValueError, match="ema_alpha"):
        PopularityConfig(moe_layers=[0], num_experts=2, ema_alpha=1.0)


def test_normalized_hhi_bounds_and_known_values():
    assert float(normalized_hhi(torch.tensor([5.0, 5.0, 5.0, 5.0]))) == pytest.approx(0.0)
    assert float(normalized_hhi(torch.tensor([0.0, 9.0, 0.0]))) == pytest.approx(1.0)
    # p = (1/2, 1/2, 0, 0): HHI = 1/2, S = (1/2 - 1/4) / (3/4) = 1/3
    assert float(normalized_hhi(torch.tensor([1.0, 1.0, 0.0, 0.0]))) == pytest.approx(1 / 3)
    rng = random.Random(1)
    for _ in range(200):
        e = rng.randint(2, 16)
        x = torch.tensor([rng.random() ** 3 for _ in range(e)])
        s = float(normalized_hhi(x))
        assert 0.0 <= s <= 1.0
        # invariant under scaling and permutation
        assert float(normalized_hhi(x[torch.randperm(e)] * 7)) == pytest.approx(s)


def test_skew_per_layer():
    pop = ExpertPopularity(PopularityConfig(moe_layers=[0, 2], num_experts=2))
    pop.record(0, torch.tensor([3, 3]))
    pop.record(2, torch.tensor([0, 6]))
    pop.end_iteration(0)
    assert pop.skew().tolist() == pytest.approx([0.0, 1.0])


def test_state_dict_round_trip_continues_exactly_even_mid_iteration():
    rng = torch.Generator().manual_seed(3)
    cfg = PopularityConfig(moe_layers=[0, 1, 2], num_experts=4, ema_alpha=0.7)
    a = ExpertPopularity(cfg)
    stream = [(_routing_map(rng, 5, 4, 1), torch.rand(5, 4, generator=rng)) for _ in range(24)]
    for i, (rmap, probs) in enumerate(stream[:10]):
        a.record(i % 3, rmap, probs)
        if i % 3 == 2:
            a.end_iteration(i // 3)
            a.mark_full(i // 3, [OperatorId.expert_op(i % 3, i % 4)])
    saved = a.state_dict()  # iteration 3 is open (one micro-batch recorded)
    b = ExpertPopularity(cfg)
    b.load_state_dict(saved)
    for pop in (a, b):
        for i, (rmap, probs) in enumerate(stream[10:], start=10):
            pop.record(i % 3, rmap, probs)
            if i % 3 == 2:
                pop.end_iteration(i // 3)
    for key, value in a.state_dict().items():
        other = b.state_dict()[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
    with pytest.raises(ValueError, match="does not match"):
        ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=4)).load_state_dict(saved)


def _gloo_worker(rank: int, world_size: int, store_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        pop = ExpertPopularity(PopularityConfig(moe_layers=[0, 1], num_experts=4), all_reduce=dist.all_reduce)
        for it in range(3):
            pop.record(0, torch.tensor([rank + 1, 0, it, 1]))
            pop.record(1, torch.tensor([0, rank, 0, 2]), probs=torch.full((2, 4), 0.25 * (rank + 1)))
            pop.end_iteration(it)
        torch.save(pop.state_dict(), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_gloo_all_reduce_gives_identical_global_counters_on_every_rank(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_gloo_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for key, value in states[0].items():
        assert torch.equal(value, states[1][key]) if isinstance(value, torch.Tensor) else value == states[1][key]
    assert states[0]["hard"].tolist() == [[9.0, 0.0, 6.0, 6.0], [0.0, 3.0, 0.0, 12.0]]
    assert states[0]["soft"][1].tolist() == [4.5] * 4  # 3 iterations x 2 tokens x (0.25 + 0.5)


@pytest.mark.gpu
def test_cuda_buffer_counts_like_the_cpu_one():
    rng = torch.Generator().manual_seed(5)
    maps = [_routing_map(rng, 16, 8, 2) for _ in range(4)]
    probs = [torch.rand(16, 8, generator=rng) for _ in range(4)]
    cpu = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=8))
    gpu = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=8, device="cuda"))
    for it, (rmap, prob) in enumerate(zip(maps, probs)):
        cpu.record(0, rmap, prob)
        gpu.record(0, rmap.cuda(), prob.cuda())
        cpu.end_iteration(it)
        gpu.end_iteration(it)
    assert torch.equal(cpu.hard, gpu.hard) and torch.allclose(cpu.soft, gpu.soft)
    assert gpu.hard.device.type == "cpu" and gpu.state_dict()["pending"].device.type == "cpu"


def test_open_buffers_follow_the_routing_device_and_read_back_once():
    """Default device: the routing tensors' (CPU here). After ``end_iteration`` the open buffers are known
    to be zero, so ``state_dict`` returns zeros without reading them; mid-iteration it copies them."""
    rng = torch.Generator().manual_seed(7)
    pop = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=4))
    assert pop.config.device is None and pop._pending.device.type == "cpu"
    rmap = _routing_map(rng, 8, 4, 2)
    pop.record(0, rmap)
    mid = pop.state_dict()
    assert mid["pending"][0, 0].tolist() == rmap.sum(0).double().tolist() and mid["routing_digest_pending"].any()
    pop.end_iteration(0)
    after = pop.state_dict()
    assert not after["pending"].any() and not after["routing_digest_pending"].any()
    resumed = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=4))
    resumed.load_state_dict(mid)  # a snapshot between micro-batches: the open counts come back
    resumed.end_iteration(0)
    assert torch.equal(resumed.hard, pop.hard) and torch.equal(resumed.routing_digest, pop.routing_digest)


def test_persisted_counter_and_states_saved_before_it():
    """``since_persisted`` counts from the last FULL a partial persist plan wrote (MoC §5.1 two-level PEC);
    ``since_entry`` reads it for an expert whose entry is that older persisted one. A state saved before the
    counter existed loads with nothing known persisted: the loss counts from the last snapshot FULL."""
    x, y = OperatorId.expert_op(0, 0), OperatorId.expert_op(0, 1)
    pop = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=2))
    for t in range(3):
        pop.record(0, torch.tensor([3.0, 4.0]))
        pop.end_iteration(t)
        pop.mark_full(t, [x, y])
        if t == 0:
            pop.mark_persisted(t, [x, y])
    pop.record(0, torch.tensor([3.0, 4.0]))
    pop.end_iteration(3)
    assert pop.since_full.tolist() == [[3.0, 4.0]] and pop.since_persisted.tolist() == [[9.0, 12.0]]
    assert pop.last_persisted_iteration.tolist() == [[0, 0]]
    # x from its snapshot FULL of 2, y from its persisted FULL of 0
    assert pop.since_entry({(0, 0): 2, (0, 1): 0}).tolist() == [[3.0, 12.0]]
    old = {k: v for k, v in pop.state_dict().items()
           if k not in ("since_persisted", "last_persisted_iteration", "full_marks", "full_marks_hard")}
    fresh = ExpertPopularity(pop.config)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.since_persisted, pop.since_full)
    assert fresh.last_persisted_iteration.tolist() == [[-1, -1]]
    assert fresh.since_entry({(0, 0): 2, (0, 1): 0}).tolist() == [[3.0, 4.0]]


def test_an_entry_older_than_the_last_full_mark_counts_its_tokens_exactly():
    """A snapshot marked FULL when submitted and dropped later (store full), or an entry skipped as corrupt,
    leaves recovery restoring the expert from an earlier entry: ``since_entry`` counts the tokens since that
    one from the expert's FULL marks (``since_full`` would count from the dropped one: too few). Beyond the
    last ``FULL_MARKS`` marks it falls back to ``since_full``; a state saved before the marks existed too."""
    from moe_ft.popularity import FULL_MARKS

    x = OperatorId.expert_op(0, 0)
    pop = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=2))
    for t in range(FULL_MARKS + 2):
        pop.record(0, torch.tensor([float(t + 1), 1.0]))
        pop.end_iteration(t)
        pop.mark_full(t, [x])
    pop.record(0, torch.tensor([100.0, 1.0]))
    pop.end_iteration(FULL_MARKS + 2)
    total = pop.hard[0, 0].item()
    for f in range(2, FULL_MARKS + 2):  # the last FULL_MARKS marks: exact
        seen = sum(t + 1 for t in range(f + 1))
        assert pop.since_entry({(0, 0): f}).tolist() == [[total - seen, 0.0]], f
    assert pop.since_entry({(0, 0): 1}).tolist() == [[100.0, 0.0]]  # forgotten: since the last mark
    old = {k: v for k, v in pop.state_dict().items() if k not in ("full_marks", "full_marks_hard")}
    fresh = ExpertPopularity(pop.config)
    fresh.load_state_dict(old)
    assert fresh.since_entry({(0, 0): 3}).tolist() == [[100.0, 0.0]]
    again = ExpertPopularity(pop.config)
    again.load_state_dict(pop.state_dict())
    assert again.since_entry({(0, 0): 3}).tolist() == pop.since_entry({(0, 0): 3}).tolist()
