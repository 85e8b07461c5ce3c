"""Distributed-optimizer shards named with their ranges, and re-assembled on another data-parallel size
(``moe_ft/state/shards.py``), and the elastic decision's union-of-ranges completeness."""

from __future__ import annotations

import pytest
import torch

from moe_ft.elastic.restart import newest_complete_point
from moe_ft.state import shards
from moe_ft.state.operators import OperatorId

P = "decoder.layers.0.self_attention.linear_qkv.weight"


def split(full: torch.Tensor, world: int) -> list[tuple[int, int]]:
    """Contiguous ranges of ``full``'s elements over ``world`` ranks, the last ones possibly empty."""
    step = -(-full.numel() // world)
    return [(min(r * step, full.numel()), min((r + 1) * step, full.numel())) for r in range(world)]


def entry(weight: torch.Tensor, moments: torch.Tensor, rng: tuple[int, int], step: float = 7.0) -> dict:
    s, e = rng
    n = weight.numel()
    return {P: weight.clone(), shards.tag("exp_avg", s, e, n, P): moments.view(-1)[s:e].clone(),
            shards.tag("step", s, e, n, P): torch.tensor(step)}


def test_tags_round_trip_and_name_the_copy_ranges():
    name = shards.tag("exp_avg", 4, 12, 48, P)
    assert name == f"exp_avg@4:12:48.{P}"
    assert shards.parse(name) == shards.ShardTag("exp_avg", 4, 12, 48, P)
    assert shards.parse(f"exp_avg.{P}") is None and shards.parse(P) is None
    assert shards.ranges_of([P, name, shards.tag("step", 4, 12, 48, P)]) == {P: (4, 12, 48)}
    assert shards.uncovered([(0, 4), (6, 9)], 0, 12) == [(4, 6), (9, 12)]
    assert shards.uncovered([(0, 12)], 3, 7) == []


@pytest.mark.parametrize("old_world,new_world", [(4, 2), (2, 4), (3, 2), (4, 1)])
def test_a_shard_of_another_world_is_assembled_bitwise_from_the_old_pieces(old_world, new_world):
    torch.manual_seed(0)
    weight, moments = torch.randn(5, 7), torch.randn(5, 7)
    old = [entry(weight, moments, rng) for rng in split(weight, old_world)]
    old_ranges = [(f"copy{r}", shards.ranges_of(c)) for r, c in enumerate(old)]
    for s, e in split(weight, new_world):
        live = {P: torch.zeros(5, 7), shards.tag("exp_avg", s, e, 35, P): torch.zeros(e - s),
                shards.tag("step", s, e, 35, P): torch.tensor(0.0)}
        chosen = shards.pick_copies({P: (s, e)}, old_ranges)
        assert 1 <= len(chosen) <= old_world
        nbytes = shards.assemble(live, [old[int(k[4:])] for k in chosen], what="test")
        assert nbytes == sum(t.nbytes for t in live.values())
        assert torch.equal(live[P], weight) and float(live[shards.tag("step", s, e, 35, P)]) == 7.0
        assert torch.equal(live[shards.tag("exp_avg", s, e, 35, P)], moments.view(-1)[s:e])


def test_a_missing_piece_is_named_never_left_as_it_was():
    weight, moments = torch.randn(10), torch.randn(10)
    pieces = [entry(weight, moments, (0, 4)), entry(weight, moments, (6, 10))]
    with pytest.raises(ValueError, match="no copy holds elements 4:6 of"):
        shards.pick_copies({P: (2, 8)}, [(str(i), shards.ranges_of(c)) for i, c in enumerate(pieces)])
    live = {P: torch.zeros(10), shards.tag("exp_avg", 2, 8, 10, P): torch.zeros(6)}
    with pytest.raises(ValueError, match="elements 4:6 of exp_avg"):
        shards.assemble(live, pieces, what="test")
    bad = {P: weight, shards.tag("exp_avg", 0, 10, 12, P): moments}  # another parameter size
    with pytest.raises(ValueError, match="does not fit"):
        shards.assemble({P: torch.zeros(10), shards.tag("exp_avg", 0, 10, 10, P): torch.zeros(10)},
                        [{P: weight, shards.tag("exp_avg", 0, 10, 10, P): moments[:0]}, bad], what="test")


def test_a_point_is_complete_only_where_the_ranges_cover_every_element():
    """Two nodes of a DP=4 job each kept two ranks' shards; the records say the gate's one parameter has
    12 elements. Node 1 lost: its ranges are missing unless node 0 holds its replicas."""
    op, required = "gate.L0", {OperatorId.gate(0)}
    sharded = {op: {P: 12}}

    def copies(*ranges):
        return [{P: (s, e, 12)} for s, e in ranges]

    node0 = {5: {op: copies((0, 3), (3, 6))}}
    assert newest_complete_point({0: node0, 1: {5: {op: copies((6, 9), (9, 12))}}}, required, sharded) == (5, "")
    point, reason = newest_complete_point({0: node0}, required, sharded)
    assert point == -1 and f"gate.L0 (optimizer state elements 6:12 of {P})" in reason and "--ft-policy dense" in reason
    with_replicas = {4: {op: copies((0, 3), (3, 6), (6, 9), (9, 12))}, **node0}
    assert newest_complete_point({0: with_replicas}, required, sharded) == (4, "")
    # a copy with no range of a parameter (this rank's range empty) is not a whole copy
    assert newest_complete_point({0: {5: {op: [{}]}}}, required, sharded)[0] == -1
    # without records the copies' own ranges say the parameter is sharded
    assert newest_complete_point({0: node0}, required)[0] == -1


def test_each_rank_takes_the_copies_that_cover_its_new_shard_and_names_a_gap():
    """``restore.choose_copies``: per operator, own copies first, as many as cover the new shard; a gap is
    the error every rank learns of together (the point is then deleted from the node stores)."""
    from moe_ft.elastic.restore import choose_copies, copy_key
    from moe_ft.state.operators import Level
    from moe_ft.state.registry import OperatorRegistry, OperatorState

    op = OperatorId.gate(0)
    live = OperatorState(op=op, compute={P: torch.zeros(12)}, optim={shards.tag("exp_avg", 3, 9, 12, P): torch.zeros(6)},
                         sharded={P: 12})
    registry = OperatorRegistry({op: live}, pp_rank=0, ep_rank=0)
    assert registry[op].tensors(Level.FULL)
    old = [{P: (s, e, 12)} for s, e in ((0, 3), (3, 6), (6, 9), (9, 12))]
    offers = {"gate.L0": [(copy_key("gate.L0", r), r) for r in old]}
    choice, error = choose_copies(registry, offers)
    assert error == "" and choice == {"gate.L0": [copy_key("gate.L0", old[1]), copy_key("gate.L0", old[2])]}
    assert copy_key("gate.L0", {}) == "gate.L0" and copy_key("gate.L0", old[1]) != copy_key("gate.L0", old[2])
    choice, error = choose_copies(registry, {"gate.L0": [(copy_key("gate.L0", old[1]), old[1])]})
    assert error == f"gate.L0: no copy holds elements 6:9 of {P}"
    assert choose_copies(registry, {})[1] == f"gate.L0: no copy holds elements 3:9 of {P}"
    whole = OperatorRegistry({op: OperatorState(op=op, compute={P: torch.zeros(12)})}, pp_rank=0, ep_rank=0)
    assert choose_copies(whole, {})[1] == "gate.L0: no rank's node has it"
    assert choose_copies(whole, offers) == ({"gate.L0": [copy_key("gate.L0", old[0])]}, "")
