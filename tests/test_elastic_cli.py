"""``moe-ft placement``: text and JSON output, errors."""

import json
from fractions import Fraction

import pytest

from moe_ft.cli.main import main
from moe_ft.placement.reliability import recovery_probability_brute_force


def _json(capsys, *argv):
    assert main(["placement", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_output_matches_brute_force(capsys):
    out = _json(capsys, "--loads", "40,30,20,10", "--nodes", "5", "--slots", "4", "--f", "1", "--failed", "3")
    assert set(out) == {"allocation", "plan", "recovery_probability"}
    assert out["allocation"] == [8, 6, 4, 2]
    plan = tuple(tuple(node) for node in out["plan"])
    assert len(plan) == 5 and all(len(node) == 4 for node in plan)
    assert list(out["recovery_probability"]) == ["3"]
    assert out["recovery_probability"]["3"] == float(recovery_probability_brute_force(plan, 4, 3))


def test_allocation_keeps_the_given_order(capsys):
    out = _json(capsys, "--loads", "10,40,20,30", "--nodes", "5", "--slots", "4", "--strategy", "mro")
    assert out["allocation"] == [2, 8, 4, 6]
    assert set(out["recovery_probability"]) == {str(k) for k in range(6)}


def test_counterexample_through_the_cli(capsys):
    # loads chosen so that eq. 1 gives [2, 2, 2, 3]
    mro = _json(capsys, "--loads", "1,1,1,1.6", "--nodes", "3", "--slots", "3", "--f", "2", "--strategy", "mro")
    best = _json(capsys, "--loads", "1,1,1,1.6", "--nodes", "3", "--slots", "3", "--f", "2")
    assert mro["allocation"] == best["allocation"] == [2, 2, 2, 3]
    assert Fraction(mro["recovery_probability"]["1"]).limit_denominator(10) == Fraction(2, 3)
    assert best["recovery_probability"]["1"] == 1.0


def test_text_output(capsys):
    assert main(["placement", "--loads", "40,30,20,10", "--nodes", "5", "--slots", "4", "--failed", "3"]) == 0
    text = capsys.readouterr().out
    assert "allocation" in text and "node 4:" in text and "3 failed: 0.700000 = 7/10" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--loads", "1,2,3", "--nodes", "1", "--slots", "2"], "cannot hold"),
        (["--loads", "1,2", "--nodes", "2", "--slots", "2", "--f", "3"], "cannot hold"),
        (["--loads", "1,2", "--nodes", "2", "--slots", "2", "--failed", "3"], "--failed"),
        (["--loads", "1,2", "--nodes", "0", "--slots", "2"], "at least one node"),
    ],
)
def test_errors(capsys, argv, message):
    assert main(["placement", *argv]) == 2
    assert message in capsys.readouterr().err
