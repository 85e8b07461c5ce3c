"""Simulator vs analytic model, concurrent/cascading failures, Dynamic-K, traces, CLI."""

import argparse
import io
import json
from contextlib import redirect_stdout

import pytest

from moe_ft.cli import simulate as sim_cli
from moe_ft.sim.analytic import evaluate
from moe_ft.sim.costmodel import CostModel
from moe_ft.sim.failures import FailureEvent, load_trace, poisson_failures
from moe_ft.sim.policies import parse_policy
from moe_ft.sim.presets import get_preset
from moe_ft.sim.simulator import Simulator, node_stages, num_nodes


@pytest.fixture(scope="module")
def cost():
    return CostModel(get_preset("deepseek-moe-16b"))


@pytest.mark.parametrize("policy,mtbf", [("dense:interval=20", 3600.0), ("gemini", 1800.0),
                                         ("sparse", 3600.0), ("checkfreq", 7200.0), ("pec:k=8", 3600.0)])
def test_simulated_ettr_matches_analytic(cost, policy, mtbf):
    """Property: when the analytic assumptions hold (Poisson failures, one node at a time, long run), the
    simulated ETTR is within 0.5 % of the renewal model and within 1 % of MoEvement's first-order one."""
    spec = parse_policy(policy)
    a = evaluate(cost, spec, mtbf)
    horizon = 3000 * 3600.0
    for seed in (1, 2):
        r = Simulator(cost, spec, mtbf).run(poisson_failures(mtbf, horizon, num_nodes(cost), seed), horizon)
        assert r.ettr == pytest.approx(a.ettr, abs=0.005)
        assert r.ettr == pytest.approx(a.ettr_first_order, abs=0.01)


def test_renewal_beats_first_order_under_cascades(cost):
    """At MTBF 2 min recoveries are often hit again; the renewal model keeps tracking the simulation."""
    spec, mtbf = parse_policy("dense:interval=10"), 120.0
    a = evaluate(cost, spec, mtbf)
    horizon = 500 * 3600.0
    r = Simulator(cost, spec, mtbf).run(poisson_failures(mtbf, horizon, num_nodes(cost), 3), horizon)
    assert abs(r.ettr - a.ettr) < 0.01
    assert abs(r.ettr - a.ettr_first_order) > 3 * abs(r.ettr - a.ettr)


def _lost(cost, policy, events):
    r = Simulator(cost, parse_policy(policy), 3600.0).run(events, 3600.0)
    return r.lost_s["restart"] + r.lost_s["recompute"], r


def test_concurrent_failures_localized(cost):
    stages = [min(node_stages(cost, k)) for k in range(num_nodes(cost))]  # one node per stage here
    single, _ = _lost(cost, "sparse", [FailureEvent(1000.0, (0,))])
    far, _ = _lost(cost, "sparse", [FailureEvent(1000.0, (0, stages.index(5)))])
    adjacent, _ = _lost(cost, "sparse", [FailureEvent(1000.0, (0, 1))])
    assert far == pytest.approx(single, rel=0.05)  # disjoint groups recover in parallel
    assert adjacent > single  # a joint segment replays with a longer pipeline
    dense_single, _ = _lost(cost, "gemini", [FailureEvent(1000.0, (0,))])
    dense_two, _ = _lost(cost, "gemini", [FailureEvent(1000.0, (0, 5))])
    assert dense_two == pytest.approx(dense_single)  # a global rollback covers both anyway


def test_cascading_failure_restarts_recovery(cost):
    one, _ = _lost(cost, "gemini", [FailureEvent(1000.0, (0,))])
    two, r = _lost(cost, "gemini", [FailureEvent(1000.0, (0,)), FailureEvent(1010.0, (3,))])
    assert r.num_failures == 2 and two == pytest.approx(one + 10.0, abs=1e-6)
    # localized, MoEvement's model: a failure of a far stage during recovery runs in parallel, ends no earlier
    paper = "sparse:localized=paper"
    far, _ = _lost(cost, paper, [FailureEvent(1000.0, (0,)), FailureEvent(1005.0, (8,))])
    single, _ = _lost(cost, paper, [FailureEvent(1000.0, (0,))])
    assert single < far < single + 10.0
    # the runtime's model: any failure during a recovery restarts it, with both stages (what moe-ft does)
    far, _ = _lost(cost, "sparse", [FailureEvent(1000.0, (0,)), FailureEvent(1005.0, (8,))])
    single, _ = _lost(cost, "sparse", [FailureEvent(1000.0, (0,))])
    both, _ = _lost(cost, "sparse", [FailureEvent(1000.0, (0, 8))])
    assert far == pytest.approx(both + 5.0, abs=1e-6) and far > single + 5.0 - 1e-6


def test_dynamic_k_grows_under_frequent_failures():
    cost = CostModel(get_preset("deepseek-moe-16b-h100-fp8-fp32-fp32"))
    spec = parse_policy("pec:k=dynamic:k0=1")
    sim = Simulator(cost, spec, 300.0)
    k0 = sim.model.knobs["k"]
    r = sim.run(poisson_failures(300.0, 6 * 3600.0, num_nodes(cost), 0), 6 * 3600.0)
    assert k0 == 1 and r.final_knobs["k"] > k0 and r.plt > 0
    # without failures nothing is lost and K stays
    r = Simulator(cost, spec, 300.0).run([], 3600.0)
    assert r.final_knobs["k"] == 1 and r.plt == 0


def test_trace_file(tmp_path, cost):
    path = tmp_path / "t.csv"
    path.write_text("time_s,nodes\n600,2\n60,0;1\n")
    events = load_trace(str(path), num_nodes(cost))
    assert events == [FailureEvent(60.0, (0, 1)), FailureEvent(600.0, (2,))]
    path.write_text("when,who\n1,2\n")
    with pytest.raises(ValueError, match="header"):
        load_trace(str(path), num_nodes(cost))
    path.write_text("time_s,nodes\n1,999\n")
    with pytest.raises(ValueError, match="nodes in"):
        load_trace(str(path), num_nodes(cost))


def _cli(argv):
    parser = argparse.ArgumentParser()
    sim_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    out = io.StringIO()
    with redirect_stdout(out):
        rc = args.func(args)
    return rc, out.getvalue()


def test_cli_json_csv_plot(tmp_path):
    csv_path, png = tmp_path / "o.csv", tmp_path / "o.png"
    rc, out = _cli(["simulate", "--preset", "deepseek-moe-16b", "--mtbf", "10m,30m", "1h", "--json",
                    "--csv", str(csv_path), "--plot", str(png), "--hours", "2"])
    assert rc == 0
    data = json.loads(out)
    assert set(data["results"]) == {"10m", "30m", "1h"}
    for per_policy in data["results"].values():
        for row in per_policy.values():
            assert {"ettr", "interval", "t_iter", "t_ckpt", "expected_recovery_s", "simulated"} <= set(row)
    assert len(csv_path.read_text().splitlines()) == 1 + 3 * 5
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_errors_and_plan():
    rc, _ = _cli(["simulate", "--preset", "nope"])
    assert rc == 2
    rc, _ = _cli(["simulate", "--preset", "deepseek-moe-16b", "--mtbf", "0m"])
    assert rc == 2
    rc, out = _cli(["plan", "--preset", "deepseek-moe-16b", "--mtbf", "20m"])
    assert rc == 0 and out.count("ETTR") >= 5 and "1. " in out


def test_set_changes_one_field_of_a_preset():
    """``--set SECTION.FIELD=VALUE``: the arena path's cost per snapshot (docs/simulator.md) in place of the
    per-byte default changes T_ckpt, and nothing else of the preset."""
    base = ["simulate", "--preset", "deepseek-moe-16b", "--mtbf", "30m", "--analytic-only", "--json",
            "--policies", "sparse", "gemini"]
    _, plain = _cli(base)
    _, arena = _cli(base + ["--set", "hardware.host_s_per_byte=0", "--set", "hardware.host_s_per_snapshot=0.016"])
    plain, arena = (json.loads(o)["results"]["30m"] for o in (plain, arena))
    assert plain["sparse"]["t_iter"] == arena["sparse"]["t_iter"]
    assert plain["sparse"]["t_ckpt"] == pytest.approx(0.44, abs=0.01)
    assert arena["sparse"]["t_ckpt"] == pytest.approx(0.016)  # per iteration: one snapshot in each
    assert arena["sparse"]["ettr"] > arena["gemini"]["ettr"] and plain["sparse"]["ettr"] < plain["gemini"]["ettr"]
