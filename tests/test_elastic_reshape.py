"""Re-planning on a world change (``moe_ft/elastic/reshape.py``, Lazarus §4.3): EP size re-derived for the
new world, new eq.-1 plans from the loads, greedy mapping onto the EP ranks with the fewest fetches, a
source for every fetch, and the experts that lost every copy named (the fallback's reason)."""

from __future__ import annotations

import random

import pytest

from moe_ft.elastic.reshape import (
    Fetch,
    rederive_expert_parallel,
    replan,
    replica_rows,
    usable_world_size,
)
from moe_ft.placement.allocation import allocate_replicas
from moe_ft.placement.layers import ExpertPlacementConfig

# previous incarnation: EP=4 over 2 nodes (EP ranks 0,1 on node 0; 2,3 on node 1), c=2, f=2
PREV = {0: [[1, 0, 1, 0], [1, 0, 0, 1], [0, 1, 1, 0], [0, 1, 0, 1]],
        1: [[1, 0, 1, 0], [0, 1, 0, 1], [1, 0, 0, 1], [0, 1, 1, 0]]}


def test_rederive_keeps_or_shrinks_expert_parallel_and_says_why():
    same = rederive_expert_parallel(8, tp=1, pp=1, ep=4, num_experts=8, slots=2, min_replicas=1)
    assert (same.ep_size, same.min_replicas, same.notes) == (4, 1, ())
    shrunk = rederive_expert_parallel(2, tp=1, pp=1, ep=4, num_experts=4, slots=2, min_replicas=2)
    assert (shrunk.ep_size, shrunk.min_replicas) == (2, 1)
    assert "expert-model-parallel-size 4 -> 2" in shrunk.notes[0] and "fault threshold f 2 -> 1" in shrunk.notes[1]
    six = rederive_expert_parallel(6, tp=1, pp=1, ep=4, num_experts=6, slots=2, min_replicas=2)
    assert (six.ep_size, six.min_replicas) == (3, 1)  # largest divisor of 6 and of E below 4 holding 6 experts
    assert rederive_expert_parallel(6, tp=1, pp=1, ep=4, num_experts=4, slots=2).ep_size == 2  # 3 does not divide 4
    with pytest.raises(ValueError, match="pipeline stages are not re-derived"):
        rederive_expert_parallel(3, tp=1, pp=2, ep=2, num_experts=4, slots=2)
    with pytest.raises(ValueError, match="raise --ft-expert-slots"):
        rederive_expert_parallel(2, tp=1, pp=1, ep=4, num_experts=8, slots=2)


def test_the_no_expert_parallel_size_error_names_slots_that_fit():
    """6 ranks, EP 4, 8 experts, 2 slots: the valid EP sizes divide 6 and 8 (2 and 1), so 2 EP ranks need 4
    slots; ceil(8 / 6) = 2 was named, with which the restart failed again."""
    with pytest.raises(ValueError, match=r"raise --ft-expert-slots to 4 \(expert-parallel size 2\)"):
        rederive_expert_parallel(6, tp=1, pp=1, ep=4, num_experts=8, slots=2)
    assert rederive_expert_parallel(6, tp=1, pp=1, ep=4, num_experts=8, slots=4).ep_size == 2
    with pytest.raises(ValueError, match=r"raise --ft-expert-slots to 7 \(expert-parallel size 1\)"):
        rederive_expert_parallel(6, tp=1, pp=1, ep=4, num_experts=7, slots=2)  # 7 experts: only EP 1 divides


def test_shrink_keeps_every_expert_from_the_surviving_node_without_fetches():
    # node 0 survives: its EP ranks 0 and 1 held every expert of PREV between them, and the new EP ranks 0, 1
    # both read node 0's stores
    held = {layer: {j: {e for e, row in enumerate(rows) if row[0] or row[1]} for j in (0, 1)}
            for layer, rows in PREV.items()}
    assert held == {0: {0: {0, 1, 2, 3}, 1: {0, 1, 2, 3}}, 1: {0: {0, 1, 2, 3}, 1: {0, 1, 2, 3}}}
    loads = {0: [10, 20, 30, 40], 1: [40, 30, 20, 10]}
    change = rederive_expert_parallel(2, tp=1, pp=1, ep=4, num_experts=4, slots=2, min_replicas=2)
    out = replan(held, loads, ep_size=change.ep_size,
                 config=ExpertPlacementConfig(slots_per_node=2, min_replicas=change.min_replicas))
    assert out.fetches == [] and out.lost == {} and out.reason == ""
    for layer, rows in out.replicas.items():
        assert [sum(col) for col in zip(*rows)] == [2, 2]  # every slot filled
        assert all(sum(row) >= 1 for row in rows)  # every expert present


def test_grow_moves_replicas_onto_the_joining_node():
    # 2 EP ranks on node 0 held experts {0, 1} and {2, 3}; the new ranks 2 and 3 are on the joining node 1
    held = {0: {0: {0, 1, 2, 3}, 1: {0, 1, 2, 3}, 2: set(), 3: set()}}
    out = replan(held, {0: [10, 20, 30, 40]}, ep_size=4, config=ExpertPlacementConfig(slots_per_node=2, min_replicas=2))
    rows = out.replicas[0]
    assert [sum(row) for row in rows] == allocate_replicas([10, 20, 30, 40], num_nodes=4, slots_per_node=2,
                                                           min_replicas=2)
    fetched = {(f.dst, f.expert_idx) for f in out.fetches}
    expected = {(j, e) for j in (2, 3) for e in range(4) if rows[e][j]}
    assert fetched == expected, "exactly the joining ranks' experts are fetched"
    assert all(f.src in (0, 1) for f in out.fetches)
    srcs = [f.src for f in out.fetches if f.expert_idx == out.fetches[0].expert_idx]
    assert len(set(srcs)) == min(len(srcs), 2), "one expert's fetches are spread over its holders"


def test_rebalance_moves_only_what_the_new_plan_needs():
    rng = random.Random(0)
    for _ in range(30):
        ep, slots, num_experts = rng.randint(2, 5), rng.randint(2, 4), rng.randint(2, 6)
        if ep * slots < num_experts:
            continue
        config = ExpertPlacementConfig(slots_per_node=slots, strategy="mro")
        old_loads = {0: [rng.random() for _ in range(num_experts)]}
        old = replan({0: {j: set() for j in range(ep)}}, old_loads, ep_size=ep, config=config)
        held = {0: {j: {e for e in range(num_experts) if old.replicas[0][e][j]} for j in range(ep)}}
        assert replan(held, old_loads, ep_size=ep, config=config).fetches == [], "unchanged loads: nothing moves"
        out = replan(held, {0: [rng.random() * 10 for _ in range(num_experts)]}, ep_size=ep, config=config)
        for f in out.fetches:
            assert f.expert_idx not in held[0][f.dst], "a rank never fetches an expert it holds"
            assert f.src is not None and f.expert_idx in held[0][f.src]
            assert out.replicas[0][f.expert_idx][f.dst] > 0
        needed = {(j, e) for j in range(ep) for e in range(num_experts)
                  if out.replicas[0][e][j] and e not in held[0][j]}
        assert {(f.dst, f.expert_idx) for f in out.fetches} == needed


def test_an_expert_with_no_surviving_copy_is_named_for_the_fallback():
    # f = 1: experts 0 and 2 on node 0, experts 1 and 3 only on node 1, which is lost
    held = {0: {0: {0, 2}}}
    out = replan(held, {0: [1, 1, 1, 1]}, ep_size=1, config=ExpertPlacementConfig(slots_per_node=4))
    assert out.lost == {0: [1, 3]}
    assert "no surviving copy of layer 0 experts [1, 3]" in out.reason
    assert Fetch(0, 1, 0, None) in out.fetches and Fetch(0, 3, 0, None) in out.fetches


def test_replica_rows_and_errors():
    assert replica_rows(((0, 0), (1, 2)), 3) == [[2, 0], [0, 1], [0, 1]]
    with pytest.raises(ValueError, match="layers of held experts"):
        replan({0: {}}, {1: [1.0]}, ep_size=1, config=ExpertPlacementConfig(slots_per_node=1))


def test_elastic_config_adjusts_the_expert_parallel_size_for_the_new_world():
    from types import SimpleNamespace

    from moe_ft.elastic.config import ElasticConfig

    def args(world, global_batch=8, tp=1, etp=None):
        return SimpleNamespace(world_size=world, model=SimpleNamespace(num_experts=4),
                               parallel=SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                                        expert_model_parallel_size=4, expert_tensor_parallel_size=etp),
                               training=SimpleNamespace(global_batch_size=global_batch, micro_batch_size=2))

    cfg = ElasticConfig(ft_elastic=True, ft_expert_slots=2)
    same = args(4)
    assert cfg.adjust_parallel(same) == [] and same.parallel.expert_model_parallel_size == 4
    shrunk = args(2)
    notes = cfg.adjust_parallel(shrunk)
    assert shrunk.parallel.expert_model_parallel_size == 2 and cfg.ft_expert_slots == 2
    assert notes and "expert-model-parallel-size 4 -> 2" in notes[0]
    with pytest.raises(ValueError, match="raise --ft-expert-slots to 2"):  # E / EP = 1 slot cannot hold 4 on 2
        ElasticConfig(ft_elastic=True).adjust_parallel(args(2))
    off = args(2)
    assert ElasticConfig().adjust_parallel(off) == [] and off.parallel.expert_model_parallel_size == 4
    # Megatron's default global batch follows the data-parallel size: not one a shrink keeps
    with pytest.raises(ValueError, match=r"pass --global-batch-size \(e.g. 8, --micro-batch-size x"):
        ElasticConfig(ft_elastic=True, ft_expert_slots=2).adjust_parallel(args(4, global_batch=None))
    # a global batch of 8 (4 micro-batches of 2) does not split over 3 ranks: 2 train, rank 2 waits
    cfg = ElasticConfig(ft_elastic=True, ft_expert_slots=4)
    three = args(3, global_batch=8)
    notes = cfg.adjust_parallel(three)
    assert (three.world_size, cfg.launched_world, three.parallel.expert_model_parallel_size) == (2, 3, 2)
    assert "world size 3 -> 2" in notes[0] and "rank 2 wait as spares" in notes[0], notes
    four = args(4, global_batch=8)
    assert cfg.adjust_parallel(four) == [] and (four.world_size, cfg.launched_world) == (4, 4)
    # the flexible dispatcher covers neither TP nor ETP: refused before the EP arithmetic, which counted TP
    # ranks instead of ETP ones (TP 2 x ETP 1 x EP 4 on 4 ranks re-derived; TP 1 x ETP 2 kept an EP that Megatron
    # refuses once EP x ETP no longer divides the world)
    for tp, etp in ((2, 1), (1, 2), (2, None)):
        with pytest.raises(ValueError, match=f"covers neither tensor nor expert tensor parallelism \\(got TP {tp}"):
            cfg.adjust_parallel(args(4, tp=tp, etp=etp))
    assert cfg.adjust_parallel(args(4, etp=1)) == []


def test_the_usable_world_keeps_the_global_batch():
    sizes = dict(tp=1, ep=1, num_experts=4, slots=4)
    assert usable_world_size(4, pp=1, global_batch=8, micro_batch=2, **sizes).usable == 4
    three = usable_world_size(3, pp=1, global_batch=8, micro_batch=2, **sizes)
    assert (three.usable, three.standby) == (2, [2])
    assert usable_world_size(7, pp=1, global_batch=12, micro_batch=1, **sizes).usable == 6
    # PP 2: 3 stage ranks each; 6 micro-batches split over 3 data-parallel ranks (2 each, >= PP)
    assert usable_world_size(7, pp=2, global_batch=6, micro_batch=1, **sizes).usable == 6
    # 4 micro-batches over 2 DP ranks leaves 2 per rank: enough for PP 2, not for PP 4
    assert usable_world_size(8, pp=2, global_batch=4, micro_batch=1, **sizes).usable == 4
    assert usable_world_size(8, pp=4, global_batch=4, micro_batch=1, **sizes).usable == 4
    # EP 4 needs 4 ranks per stage holding 4 experts: none of 3 and fewer ranks fits with 1 slot each
    with pytest.raises(ValueError, match="no world of at most 3 ranks keeps the global batch of 8"):
        usable_world_size(3, pp=1, global_batch=8, micro_batch=1, tp=1, ep=4, num_experts=4, slots=1)
    with pytest.raises(ValueError, match="multiple of --micro-batch-size"):
        usable_world_size(4, pp=1, global_batch=9, micro_batch=2, **sizes)


def test_pipeline_stages_record_their_own_layers_and_the_decision_merges_them():
    """With PP > 1 each rank's layout record holds its stage's layers: the previous plan of every layer is
    the newest record of the newest generation that has it, and a layer belongs to the stage whose first
    MoE layer is the largest not above it (the experts a stage's EP rank holds are looked up there)."""
    from moe_ft.elastic.inventory import LayoutRecord, newest_record
    from moe_ft.elastic.restart import stage_of_layers

    def rec(gen, it, layers):
        return LayoutRecord(generation=gen, world_size=4, ep_size=1, iteration=it,
                            plans={layer: [[layer + 1]] for layer in layers},
                            loads={layer: [float(it)] for layer in layers})

    stage0_old, stage0, stage1 = rec(1, 9, [0, 1]), rec(1, 7, [0, 1]), rec(1, 8, [2, 3])
    merged = newest_record([rec(0, 20, [0, 1, 2, 3, 4]), stage0, stage0_old, stage1])
    assert (merged.generation, merged.iteration) == (1, 9)
    assert sorted(merged.plans) == [0, 1, 2, 3], "an older generation's layer must not leak in"
    assert merged.loads[0] == [9.0] and merged.loads[2] == [8.0], "each layer from its newest record"
    assert newest_record([]) is None
    assert stage_of_layers({0: 0, 1: 2}, [0, 1, 2, 3]) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert stage_of_layers({1: 3, 0: 1}, [1, 2, 3, 5]) == {1: 0, 2: 0, 3: 1, 5: 1}  # stage 0 starts dense
    with pytest.raises(ValueError, match="before every stage"):
        stage_of_layers({0: 1, 1: 3}, [0])
