"""Sparse replay reproduces routing, not only per-expert counts: the popularity counters
keep a per-layer digest of the routing decisions (``moe_ft.popularity.routing_digest``) that travels with
each snapshot's metadata, and ``moe_ft.recovery.machine.check_routing`` compares it during replay.
(The exact drills in ``tests/test_recovery_drill.py`` show real replays reproduce it.)"""

from __future__ import annotations

import pytest
import torch

from moe_ft.popularity import ExpertPopularity, PopularityConfig, routing_digest
from moe_ft.recovery.machine import check_routing

pytestmark = pytest.mark.timeout(60)


def top2_map(num_tokens=16, num_experts=4, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randn(num_tokens, num_experts, generator=g).topk(2, dim=-1).indices
    return torch.zeros(num_tokens, num_experts, dtype=torch.bool).scatter(1, idx, True)


def swap_two_tokens(rmap: torch.Tensor) -> torch.Tensor:
    """Two tokens exchange one expert each: every expert keeps its token count, the routing differs."""
    out = rmap.clone()
    for a in range(rmap.shape[0]):
        for b in range(a + 1, rmap.shape[0]):
            only_a = (rmap[a] & ~rmap[b]).nonzero().flatten()
            only_b = (rmap[b] & ~rmap[a]).nonzero().flatten()
            if len(only_a) and len(only_b):
                ea, eb = int(only_a[0]), int(only_b[0])
                out[a, ea], out[a, eb], out[b, eb], out[b, ea] = False, True, False, True
                assert torch.equal(out.sum(0), rmap.sum(0)) and not torch.equal(out, rmap)
                return out
    raise AssertionError("no swappable pair")


def closed(maps_per_layer: list[list[torch.Tensor]]) -> ExpertPopularity:
    """Popularity counters after one iteration whose micro-batches route as ``maps_per_layer``."""
    pop = ExpertPopularity(PopularityConfig(moe_layers=list(range(len(maps_per_layer))), num_experts=4))
    for mb in range(len(maps_per_layer[0])):
        for layer, maps in enumerate(maps_per_layer):
            pop.record(layer, maps[mb])
    pop.end_iteration(0)
    return pop


def recorded(pop: ExpertPopularity) -> dict:
    """What the snapshot metadata holds (``moe_ft/snapshot/meta.py``: ``popularity.<tensor>``)."""
    return {f"popularity.{k}": v for k, v in pop.state_dict().items() if isinstance(v, torch.Tensor)}


def test_digest_sees_swaps_and_microbatch_order():
    rmap = top2_map()
    assert routing_digest(rmap, 0) == routing_digest(rmap.clone(), 0)
    assert routing_digest(swap_two_tokens(rmap), 0) != routing_digest(rmap, 0)
    assert routing_digest(rmap, 1) != routing_digest(rmap, 0)
    other = top2_map(seed=1)
    a, b = closed([[rmap, other]]), closed([[other, rmap]])  # same tokens per expert, micro-batches swapped
    assert torch.equal(a.last_counts, b.last_counts) and not torch.equal(a.routing_digest, b.routing_digest)


def test_digest_survives_state_dict_mid_iteration():
    maps = [top2_map(seed=s) for s in range(3)]
    ref = closed([maps])
    pop = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=4))
    pop.record(0, maps[0])
    resumed = ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=4))
    resumed.load_state_dict(pop.state_dict())  # a snapshot taken between micro-batches
    for m in maps[1:]:
        resumed.record(0, m)
    resumed.end_iteration(0)
    assert torch.equal(resumed.routing_digest, ref.routing_digest)
    legacy = {k: v for k, v in pop.state_dict().items() if not k.startswith("routing_")}
    ExpertPopularity(PopularityConfig(moe_layers=[0], num_experts=4)).load_state_dict(legacy)  # older snapshots


def test_replay_with_perturbed_routing_is_detected():
    maps = [[top2_map(seed=0), top2_map(seed=1)], [top2_map(seed=2), top2_map(seed=3)]]  # 2 layers x 2 mbs
    original = recorded(closed(maps))
    check_routing(closed(maps), original, 5)  # a faithful replay passes
    perturbed = [maps[0], [maps[1][0], swap_two_tokens(maps[1][1])]]
    replay = closed(perturbed)
    assert torch.equal(replay.last_counts, original["popularity.last_counts"]), "counts alone would not see it"
    with pytest.raises(RuntimeError, match=r"iteration 5: the routing decisions .* MoE layer\(s\) \[1\]"):
        check_routing(replay, original, 5)
    shifted = [maps[0], [maps[1][0], top2_map(seed=9)]]
    with pytest.raises(RuntimeError, match="per-expert token counts differ"):
        check_routing(closed(shifted), original, 5)
    del original["popularity.routing_digest"]  # a snapshot from before the digest: counts are still checked
    check_routing(replay, original, 5)
