"""``--ft-pec-k-persist`` (MoC-System §5.1 two-level PEC): K_persist experts per layer of each checkpoint go
to the durable tier, 1 <= K_persist <= K_snapshot, from the command line to the policy's persist plan."""

from __future__ import annotations

import argparse

import pytest
from test_policy_common import make_catalog

from megatron.training.argument_utils import add_dataclass_arguments, dataclass_from_args
from moe_ft.config import FTConfig
from moe_ft.policy import build_policy, policy_class
from moe_ft.state.operators import Level


def _parse(argv: list[str]) -> FTConfig:
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, FTConfig, "fault tolerance")
    return dataclass_from_args(FTConfig, parser.parse_args(argv))


def test_flag_reaches_the_persist_plan():
    config = _parse(["--ft", "--ft-policy", "pec", "--ft-pec-k", "4", "--ft-pec-k-persist", "3"])
    assert (config.snapshot.pec_k, config.snapshot.pec_k_persist) == (4, 3)
    pec = policy_class("pec")
    pec_config = pec.config_from_flags(config.snapshot, 1.0)
    assert (pec_config.k_snapshot, pec_config.k_persist) == (4, 3)
    policy = build_policy("pec", pec_config, make_catalog(2, 8, ep=2))
    for t in range(6):
        snapshot = policy.plan(t)
        persisted = [op for op, lvl in policy.persist_plan(t, snapshot).items() if op.is_expert and lvl == Level.FULL]
        assert sorted(op.layer for op in persisted) == [0, 0, 0, 1, 1, 1]
        assert all(snapshot[op] == Level.FULL for op in persisted)


def test_default_is_one():
    assert _parse(["--ft", "--ft-policy", "pec", "--ft-pec-k", "2"]).snapshot.pec_k_persist == 1


@pytest.mark.parametrize("k, k_persist", [(2, 0), (2, 3), (1, -1)])
def test_out_of_range_is_refused_with_the_rule(k, k_persist):
    with pytest.raises(ValueError, match=r"--ft-pec-k-persist must be in \[1, --ft-pec-k=%d\]" % k):
        FTConfig.from_flags(ft_policy="pec", ft_pec_k=k, ft_pec_k_persist=k_persist)
