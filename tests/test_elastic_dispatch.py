"""Flexible dispatcher arithmetic (Lazarus Alg. 1): schedule invariants, reference vs Triton (interpreter).

``TRITON_INTERPRET`` is read when a ``triton.jit`` kernel is decorated, i.e. when
``moe_ft.megatron_ext.dispatch.permute_triton`` is first imported; that module is imported only here (lazily by
``dispatch.py``), so setting the variable before that import is enough even if torch or triton were
imported by other test modules first.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from moe_ft.megatron_ext.dispatch.arithmetic import (  # noqa: E402
    DispatchConfig,
    all_send_counts,
    build_permutation,
    capacity,
    dispatch_schedule,
    permute,
    recv_expert_order,
    unpermute,
)

torch.set_num_threads(1)
TRITON = DispatchConfig(backend="triton")
TORCH = DispatchConfig(backend="torch")


def _have_interpreter():
    from moe_ft.megatron_ext.dispatch import permute_triton as dispatch_triton

    return dispatch_triton.HAVE_TRITON and os.environ.get("TRITON_INTERPRET") == "1"


def _random_case(gen, world, num_experts, tokens, topk, kind):
    """Routing of every rank ([W] x [tokens, topk]) and a replica map [E, W] with every expert placed."""
    if kind == "skewed":
        weights = torch.tensor([100.0] + [0.01] * (num_experts - 1))
    elif kind == "empty":
        weights = torch.ones(num_experts)
        weights[: max(1, num_experts // 2)] = 0.0  # half the experts get no token at all
    else:
        weights = torch.rand(num_experts, generator=gen) + 0.05
    routing = [
        torch.multinomial(weights.expand(tokens, -1), topk, replacement=False, generator=gen) if tokens else
        torch.zeros(0, topk, dtype=torch.int64)
        for _ in range(world)
    ]
    replicas = torch.randint(0, 3, (num_experts, world), generator=gen)
    for e in range(num_experts):
        if replicas[e].sum() == 0:
            replicas[e, torch.randint(0, world, (1,), generator=gen)] = 1
    tpe = torch.stack([torch.bincount(r.reshape(-1), minlength=num_experts) for r in routing], dim=1)
    return routing, replicas, tpe


CASES = [(1, 3, 7, 2, "random"), (4, 6, 9, 2, "random"), (3, 5, 8, 1, "empty"), (4, 4, 10, 3, "skewed"),
         (2, 3, 0, 2, "random"), (6, 8, 4, 3, "random")]


@pytest.mark.parametrize("world, num_experts, tokens, topk, kind", CASES)
def test_schedule_invariants(world, num_experts, tokens, topk, kind):
    gen = torch.Generator().manual_seed(world * 100 + tokens)
    _, replicas, tpe = _random_case(gen, world, num_experts, tokens, topk, kind)
    counts = all_send_counts(tpe, replicas)  # [src, e, dst]
    cap = capacity(tpe, replicas)
    assert torch.equal(counts.sum(2), tpe.T)  # every routed slot is sent exactly once
    assert torch.equal(counts.sum(0), cap)  # every rank receives exactly its capacity
    assert torch.equal(cap.sum(1), tpe.sum(1))
    per_replica = torch.div(tpe.sum(1, keepdim=True), replicas.sum(1, keepdim=True), rounding_mode="floor")
    assert ((cap - per_replica * replicas) >= 0).all() and ((cap - per_replica * replicas) <= replicas).all()
    diag = counts[torch.arange(world), :, torch.arange(world)]  # [W, E] kept locally
    assert torch.equal(diag, torch.minimum(cap, tpe).T)  # local replicas first
    for rank in range(world):
        sched = dispatch_schedule(tpe, replicas, rank)
        assert torch.equal(sched.send_counts, counts[rank])
        assert torch.equal(sched.recv_counts, counts[:, :, rank])


def test_schedule_example_and_errors():
    tpe = torch.tensor([[5, 0, 3], [1, 7, 2]])
    replicas = torch.tensor([[1, 1, 0], [0, 1, 2]])
    assert capacity(tpe, replicas).tolist() == [[4, 4, 0], [0, 4, 6]]
    assert dispatch_schedule(tpe, replicas, 1).send_counts.tolist() == [[0, 0, 0], [0, 4, 3]]
    with pytest.raises(ValueError, match="no replica"):
        dispatch_schedule(tpe, torch.tensor([[1, 1, 0], [0, 0, 0]]), 0)
    with pytest.raises(ValueError, match="outside world size"):
        dispatch_schedule(tpe, replicas, 3)
    sched = dispatch_schedule(tpe, replicas, 0)
    with pytest.raises(ValueError, match="does not match"):
        build_permutation(torch.tensor([[0, 1], [1, 1], [0, 0]]), sched)
    with pytest.raises(ValueError, match="unknown dispatch backend"):
        DispatchConfig(backend="cuda")


def _simulate_layer(routing, replicas, tpe, probs, hidden, config):
    """All ranks of one MoE layer with the all-to-alls done by slicing; expert e multiplies by (e + 1)."""
    world, num_experts = len(routing), replicas.shape[0]
    scheds = [dispatch_schedule(tpe, replicas, i) for i in range(world)]
    perms = [build_permutation(routing[i], scheds[i], config) for i in range(world)]
    sends = [permute(hidden[i], perms[i], config) for i in range(world)]
    chunks = [list(torch.split(sends[i], scheds[i].input_split_sizes)) for i in range(world)]
    outs = []
    for i in range(world):
        recv = torch.cat([chunks[j][i] for j in range(world)])  # grouped by (source rank, expert)
        expert_of_row = torch.repeat_interleave(
            torch.arange(num_experts).repeat(world), scheds[i].recv_counts.reshape(-1)
        )
        order = recv_expert_order(scheds[i])
        assert (expert_of_row[order].diff() >= 0).all()  # expert-major after reordering
        assert torch.equal(torch.sort(order).values, torch.arange(recv.shape[0]))  # a permutation
        assert torch.equal(torch.bincount(expert_of_row, minlength=num_experts), capacity(tpe, replicas)[:, i])
        y = recv * (expert_of_row[:, None] + 1).to(recv.dtype)
        outs.append(list(torch.split(y, scheds[i].output_split_sizes)))
    results = []
    for i in range(world):
        back = torch.cat([outs[j][i] for j in range(world)])  # return all-to-all
        results.append(unpermute(back, perms[i], probs[i], config))
    return perms, sends, results


@pytest.mark.parametrize("world, num_experts, tokens, topk, kind", CASES)
def test_reference_layer_equals_direct_computation(world, num_experts, tokens, topk, kind):
    gen = torch.Generator().manual_seed(7 + world + tokens)
    routing, replicas, tpe = _random_case(gen, world, num_experts, tokens, topk, kind)
    probs = [torch.rand(tokens, topk, generator=gen) for _ in range(world)]
    hidden = [torch.randn(tokens, 5, generator=gen) for _ in range(world)]
    _, _, results = _simulate_layer(routing, replicas, tpe, probs, hidden, TORCH)
    for i in range(world):
        expected = torch.zeros(tokens, 5)
        for k in range(topk):
            expected = expected + probs[i][:, k : k + 1] * (hidden[i] * (routing[i][:, k : k + 1] + 1).float())
        torch.testing.assert_close(results[i], expected)


@pytest.mark.parametrize(
    "world, num_experts, tokens, topk, kind, dtype",
    [case + (torch.float32,) for case in CASES] + [CASES[1] + (torch.bfloat16,), CASES[3] + (torch.float16,)],
)
def test_triton_equals_reference_exactly(world, num_experts, tokens, topk, kind, dtype):
    if not _have_interpreter():
        pytest.fail("triton must be installed for this test (pip install 'moe-ft[test]')")
    gen = torch.Generator().manual_seed(11 + world * tokens)
    routing, replicas, tpe = _random_case(gen, world, num_experts, tokens, topk, kind)
    probs = [torch.rand(tokens, topk, generator=gen) for _ in range(world)]
    hidden = [torch.randn(tokens, 6, generator=gen).to(dtype) for _ in range(world)]
    ref = _simulate_layer(routing, replicas, tpe, probs, hidden, TORCH)
    tri = _simulate_layer(routing, replicas, tpe, probs, hidden, TRITON)
    for a, b in zip(ref[0], tri[0]):
        assert torch.equal(a.slot_of_pos, b.slot_of_pos) and torch.equal(a.pos_of_slot, b.pos_of_slot)
        assert torch.equal(a.slot_of_pos[a.pos_of_slot], torch.arange(a.pos_of_slot.numel()))
    for a, b in zip(ref[1] + ref[2], tri[1] + tri[2]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_triton_positions_across_blocks_and_many_ranks():
    """Slots spanning several kernel blocks, and a world large enough for a multi-step binary search."""
    if not _have_interpreter():
        pytest.fail("triton must be installed for this test (pip install 'moe-ft[test]')")
    from moe_ft.megatron_ext.dispatch.permute_ref import positions_reference
    from moe_ft.megatron_ext.dispatch.permute_triton import positions_triton

    gen = torch.Generator().manual_seed(5)
    world, num_experts = 37, 3
    routing, replicas, tpe = _random_case(gen, world, num_experts, 150, 2, "random")
    sched = dispatch_schedule(tpe, replicas, 4)
    ref = positions_reference(routing[4], sched.send_counts)
    tri = positions_triton(routing[4], sched.send_counts, block=32)
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
