"""Simulator honesty: ``sparse`` models what the runtime's localized recovery does under ``moe-ft launch``
(the lost node is detected by its heartbeat, spares take its ranks, the survivors keep their processes
but dump and reload their state, only the failed stage replays); ``sparse:launcher=torchrun`` is the full
restart (plain torchrun, or the launcher's fallback when no spare is left); the paper's localized restart
stays available as ``sparse:localized=paper``."""

import pytest

from moe_ft.sim.advisor import plan
from moe_ft.sim.analytic import build_model, evaluate
from moe_ft.sim.costmodel import CostModel
from moe_ft.sim.policies import parse_policy
from moe_ft.sim.presets import get_preset


@pytest.fixture(scope="module")
def cost():
    return CostModel(get_preset("deepseek-moe-16b"))


def test_parse_variants():
    assert (parse_policy("sparse").localized, parse_policy("sparse").localized_model) == (True, "runtime")
    assert parse_policy("sparse:localized=runtime").localized_model == "runtime"
    paper = parse_policy("sparse:localized=paper")
    assert paper.localized and paper.localized_model == "paper"
    assert not parse_policy("sparse:localized=0").localized
    with pytest.raises(ValueError, match="localized must be 0, 1, 'runtime' or 'paper'"):
        parse_policy("sparse:localized=maybe")
    assert parse_policy("sparse").launcher == "inprocess"
    assert parse_policy("sparse:launcher=torchrun").launcher == "torchrun"
    with pytest.raises(ValueError, match="launcher must be 'inprocess' or 'torchrun'"):
        parse_policy("sparse:launcher=slurm")


def test_restart_terms(cost):
    cfg, hw = cost.config, cost.config.hardware
    held = cost.max_held_bytes
    load = held / hw.network_bandwidth
    runtime = build_model(cost, parse_policy("sparse"), 3600.0)
    paper = build_model(cost, parse_policy("sparse:localized=paper"), 3600.0)
    off = build_model(cost, parse_policy("sparse:localized=0:launcher=torchrun"), 3600.0)
    torchrun = build_model(cost, parse_policy("sparse:launcher=torchrun"), 3600.0)
    assert paper.restart_load_s() == pytest.approx(cfg.recovery.localized_restart_s + load)
    assert off.restart_load_s() == pytest.approx(cfg.recovery.restart_s + load)
    # the survivors write their state to host memory and read it back; under torchrun every rank restarts
    dump = 2 * held / hw.d2h_bandwidth
    assert torchrun.restart_load_s() == pytest.approx(cfg.recovery.restart_s + dump + load)
    inprocess = cfg.recovery.inprocess_detect_s + cfg.recovery.inprocess_reform_s
    assert runtime.restart_load_s() == pytest.approx(inprocess + dump + load)
    assert inprocess < cfg.recovery.restart_s


def test_runtime_sits_between_the_paper_and_the_global_replay(cost):
    er = {p: evaluate(cost, parse_policy(p), 1800.0).expected_recovery_s
          for p in ("sparse:localized=paper", "sparse", "sparse:launcher=torchrun", "sparse:localized=0:launcher=torchrun")}
    assert er["sparse"] < er["sparse:launcher=torchrun"] < er["sparse:localized=0:launcher=torchrun"]
    assert er["sparse:localized=paper"] < er["sparse:launcher=torchrun"]


def test_plan_explains_the_runtime_scope(cost):
    recs = {r.result.model.spec.label: r.reason
            for r in plan(cost, 1800.0, policies=("sparse", "sparse:launcher=torchrun", "sparse:localized=paper"))}
    assert "spares take the lost ranks, survivors keep their processes, survivors reload their state" in recs["sparse"]
    assert "every rank restarts, survivors reload their state" in recs["sparse:launcher=torchrun"]
    assert "MoEvement's localized restart" in recs["sparse:localized=paper"]
