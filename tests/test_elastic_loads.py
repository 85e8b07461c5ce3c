"""``--ft-expert-loads-from``: per-layer loads from an ``--ft-trace-out`` file -> one eq.-1 plan per layer;
errors for missing, corrupt and mismatching traces, at argument parsing."""

from __future__ import annotations

import json

import pytest

from moe_ft.elastic.config import ElasticConfig
from moe_ft.placement.allocation import allocate_replicas
from moe_ft.placement.loads import read_trace_loads

pytestmark = pytest.mark.timeout(60)

LAYER0 = [[9, 1, 1, 1], [5, 3, 2, 2]]  # two iterations of a 2-layer, 4-expert model
LAYER1 = [[1, 1, 1, 9], [2, 2, 3, 5]]


def _write(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


@pytest.fixture
def trace(tmp_path):
    lines = [{"iteration": t, "replay": False, "counts": [LAYER0[t], LAYER1[t]], "full_experts": []}
             for t in range(2)]
    return _write(tmp_path / "trace.jsonl", lines)


def test_sums_counts_per_layer(trace):
    loads = read_trace_loads(trace)
    assert loads.counts == ((14, 4, 3, 3), (3, 3, 4, 14)) and loads.iterations == (0, 1)
    assert read_trace_loads(trace, window=1).counts == ((5, 3, 2, 2), (2, 2, 3, 5))


def test_replays_skipped_and_last_line_of_an_iteration_wins(tmp_path):
    lines = [{"iteration": 0, "counts": [[1, 1]]}, {"iteration": 1, "counts": [[4, 0]]},
             {"iteration": 1, "replay": True, "counts": [[100, 100]]},  # re-executed after a recovery
             {"iteration": 1, "counts": [[0, 6]]}]  # a resumed run appending to the same file
    assert read_trace_loads(_write(tmp_path / "t.jsonl", lines)).counts == ((1, 7),)


def test_every_layer_gets_its_own_allocation(trace):
    cfg = ElasticConfig(ft_expert_replicas=["auto"], ft_expert_loads_from=trace, ft_expert_slots=3)
    for layer, loads in enumerate(([14, 4, 3, 3], [3, 3, 4, 14])):
        r = cfg.replica_map(4, 4, layer)
        assert r.sum(1).tolist() == allocate_replicas(loads, num_nodes=4, slots_per_node=3, min_replicas=1)
        assert r.sum(0).tolist() == [3, 3, 3, 3]
    assert cfg.replica_map(4, 4, 0).sum(1).tolist() != cfg.replica_map(4, 4, 1).sum(1).tolist()
    with pytest.raises(ValueError, match="need the layer index"):
        cfg.replica_map(4, 4)


@pytest.mark.parametrize("content, match", [
    ("", "no trained iteration"),
    ('{"iteration": 0, "counts": [[1, 2]]}\nnot json\n', r":2: not JSON"),
    ('{"iteration": 0}\n', "with 'iteration' and 'counts'"),
    ('{"iteration": 0, "counts": [[1, -2]]}\n', "non-negative"),
    ('{"iteration": 0, "counts": [[1, NaN]]}\n', "finite"),
    ('{"iteration": 0, "counts": [[1, 2], [3]]}\n', "different numbers of experts"),
    ('{"iteration": 0, "counts": [[1, 2]]}\n{"iteration": 1, "counts": [[1, 2, 3]]}\n', "mixes runs"),
    ('{"iteration": 0, "replay": true, "counts": [[1, 2]]}\n', "only replays"),
])
def test_corrupt_traces_are_refused(tmp_path, content, match):
    path = tmp_path / "t.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        read_trace_loads(str(path))


def test_flag_errors(tmp_path, trace):
    with pytest.raises(ValueError, match="cannot read the expert loads trace"):
        ElasticConfig(ft_expert_replicas=["auto"], ft_expert_loads_from=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="only used with --ft-expert-replicas auto"):
        ElasticConfig(ft_expert_replicas=["2", "2"], ft_expert_loads_from=trace)
    with pytest.raises(ValueError, match="both give the loads"):
        ElasticConfig(ft_expert_replicas=["auto"], ft_expert_loads_from=trace, ft_expert_loads=[1.0] * 4)
    with pytest.raises(ValueError, match="needs --ft-expert-loads-from"):
        ElasticConfig(ft_expert_loads_window=3)


@pytest.mark.parametrize("model, match", [
    (["--num-layers", "3", "--num-experts", "4"], "counts 2 MoE layers x 4 experts but this model has 3 x 4"),
    (["--num-layers", "2", "--num-experts", "8"], "counts 2 MoE layers x 4 experts but this model has 2 x 8"),
])
def test_trace_of_another_model_refused_at_parsing(trace, data_prefix, model, match):
    from megatron.training.arguments import ArgumentError, parse_args
    from pretrain_gpt_moe import extra_argument_groups

    flags = [*model, "--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "auto",
             "--ft-expert-loads-from", trace, "--data-path", data_prefix]
    with pytest.raises(ArgumentError, match=match):
        parse_args(flags, world_size=1, extra_groups=extra_argument_groups())
    ok = parse_args(["--num-layers", "2", "--num-experts", "4", *flags[4:]], world_size=1,
                    extra_groups=extra_argument_groups())
    assert ok.extra["ElasticConfig"].measured.counts[0] == (14, 4, 3, 3)


def test_save_load_refused_only_with_the_distributed_optimizer(data_prefix):
    from megatron.training.arguments import ArgumentError, parse_args

    flags = ["--moe-token-dispatcher-type", "flexible", "--save", "ckpt", "--data-path", data_prefix]
    assert parse_args(flags, world_size=1).training.save == "ckpt"
    with pytest.raises(ArgumentError, match="need the plain optimizer"):
        parse_args([*flags, "--use-distributed-optimizer"], world_size=1)
