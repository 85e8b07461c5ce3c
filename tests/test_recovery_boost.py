"""MoEtion §6 capacity boost started by the runtime after a lossy recovery (``--ft-capacity-boost``,
``moe_ft/recovery/boost.py``), with a real SIGKILL under torchrun.

A pec job with token dropping (``--moe-expert-capacity-factor 0.5``: every expert is over capacity in most
micro-batches) loses rank 1 at the start of iteration 7. After the restart each expert comes back from its
newest FULL entry; the test recomputes from the per-iteration counters (``--ft-trace-out``) which experts
are stale and how many tokens each lost, and checks that the boost starts for exactly those experts with
exactly those counts, that they keep more tokens than the base capacity allows while boosted (and the
others never do), and that each boost ends in the iteration its tokens are made up. The boost is 100 % here (the
paper's 10 % would take tens of iterations to make up ~200 tokens) to keep the test short.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moe_ft.cli.drill import run_job

ITERS, FAIL_AT = 12, 7
CAPACITY_FACTOR, BOOST = 0.5, 1.0
# tiny job (moe_ft/cli/drill.py TINY), layout ep2pp2: 2 data-parallel ranks per stage x 2 micro-batches of
# 2 x 32 tokens, 4 experts, top-2: per micro-batch and rank an expert keeps ceil(64 * 2 / 4 * factor) tokens
MICROBATCHES_PER_LAYER = 2 * 2
BASE = MICROBATCHES_PER_LAYER * math.ceil(64 * 2 / 4 * CAPACITY_FACTOR)
BOOSTED = MICROBATCHES_PER_LAYER * math.ceil(64 * 2 / 4 * CAPACITY_FACTOR * (1 + BOOST))


def trace_lines(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def lost_per_expert(lines: list[dict], end: int) -> dict[tuple[int, int], float]:
    """Tokens each expert was routed (and kept) after its newest FULL at or before ``end``, from the first
    incarnation's counters (world-summed, rank 0's trace)."""
    first: dict[int, dict] = {}
    for rec in lines:
        first.setdefault(rec["iteration"], rec)
    num_layers, num_experts = len(first[0]["counts"]), len(first[0]["counts"][0])
    lost = {}
    for layer in range(num_layers):
        for expert in range(num_experts):
            fulls = [t for t in range(end + 1) if [layer, expert] in first[t]["full_experts"]]
            newest = fulls[-1] if fulls else -1
            tokens = sum(first[t]["counts"][layer][expert] for t in range(newest + 1, end + 1))
            if tokens:
                lost[(layer, expert)] = tokens
    return lost


@pytest.mark.timeout(60)
def test_flag_needs_a_lossy_policy_and_token_dropping():
    from types import SimpleNamespace

    from moe_ft.config import FTConfig

    with pytest.raises(ValueError, match="use it with --ft-policy pec or selective"):
        FTConfig.from_flags(ft=True, ft_policy="sparse", ft_capacity_boost=0.1)
    with pytest.raises(ValueError, match=">= 0"):
        FTConfig.from_flags(ft=True, ft_policy="pec", ft_capacity_boost=-0.1)
    cfg = FTConfig.from_flags(ft=True, ft_policy="pec", ft_capacity_boost=0.1)

    def _args(factor):  # the model flags check_args reads (capacity factor, precision)
        model = SimpleNamespace(moe_expert_capacity_factor=factor, bf16=False, fp16=False, fp8_format=None,
                                fp8_recipe="delayed")
        return SimpleNamespace(model=model, training=SimpleNamespace(loss_scale=None), extra={})
    assert cfg.needs_popularity  # the lost tokens per expert must be the whole job's
    with pytest.raises(ValueError, match="set --moe-expert-capacity-factor"):
        cfg.check_args(_args(None))
    cfg.check_args(_args(1.0))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_capacity_boost_after_pec_recovery(corpus, tmp_path):
    trace = str(tmp_path / "trace.jsonl")
    res = run_job(job="boost", workdir=str(tmp_path), faults=[f"1:{FAIL_AT}:forward"], max_restarts=1,
                  timeout=280, layout="ep2pp2", policy="pec", iters=ITERS, data=corpus,
                  store=str(tmp_path / "store"), window=3,
                  extra=["--moe-expert-capacity-factor", str(CAPACITY_FACTOR), "--ft-capacity-boost", str(BOOST),
                         "--ft-pec-k", "1", "--ft-trace-out", trace, "--ft-log-interval", "1"])
    assert res["rc"] == 0, res["log"]
    (report,) = res["reports"]
    rp, cb = report["recovery_point"], report["capacity_boost"]
    end, resume = rp["end"], rp["resume"]
    assert rp["source"] == "memory" and resume == end + 1 and report["token_loss"]["metric"] == "PLT"

    lines = trace_lines(trace)
    lost = lost_per_expert(lines, end)
    assert lost, "the recovery should have lost tokens"
    # the boost starts for exactly the stale experts, with exactly their lost tokens (no earlier deficit)
    assert {(e["layer"], e["expert"]): e["tokens"] for e in cb["experts"]} == lost
    assert all(e["lost"] == e["tokens"] and e["carried"] == 0 for e in cb["experts"])
    assert cb["started_at"] == resume and cb["tokens_to_make_up"] == sum(lost.values())
    assert cb["boost"] == BOOST and cb["capacity_factor"] == CAPACITY_FACTOR

    # after the restart: the second incarnation's lines, from the resume iteration on
    after = [rec for rec in lines if rec["iteration"] >= resume][-(ITERS - resume):]
    assert [rec["iteration"] for rec in after] == list(range(resume, ITERS))
    made_up = {(e["layer"], e["expert"]): e["made_up_at"] for e in cb["experts"]}
    assert any(it is not None for it in made_up.values()), cb
    assert all(it is None or resume <= it < ITERS for it in made_up.values()), cb
    deficit = dict(lost)
    bigger = 0
    for rec in after:
        t = rec["iteration"]
        for layer, row in enumerate(rec["counts"]):
            for expert, kept in enumerate(row):
                key = (layer, expert)
                boosted = key in made_up and (made_up[key] is None or t <= made_up[key])
                assert kept <= (BOOSTED if boosted else BASE), (t, key, kept)
                bigger += kept > BASE
                if boosted:  # every token kept beyond the base capacity pays the deficit off
                    left = rec["boost_deficit"][layer][expert]
                    assert deficit[key] - left >= min(deficit[key], kept - BASE) > 0 or kept <= BASE, (t, key)
                    deficit[key] = left
                    assert (left == 0) == (t == made_up[key]), (t, key, left)
    assert bigger > 0, "no boosted expert kept more tokens than the base capacity allows"
    # each boost ends in the iteration its deficit reaches zero; an expert that rarely exceeds its base
    # capacity drops (almost) nothing and has nothing to make up: its boost may outlast this short run
    assert {key for key, left in deficit.items() if left > 0} == {key for key, it in made_up.items() if it is None}
    ended = [it for it in made_up.values() if it is not None]
    assert cb["ended_at"] == (max(ended) if None not in made_up.values() else None)
    before = lines[: len(lines) - len(after)]  # the first incarnation (and its lost iterations): equal factors
    assert before and all(kept <= BASE for rec in before for row in rec["counts"] for kept in row)
    log = Path(res["log"]).read_text()
    assert f"capacity boost +100 % for {len(lost)} experts, {sum(lost.values()):.0f} tokens to make up" in log
    assert "| capacity boost " in log  # the FT line while the boost is active
