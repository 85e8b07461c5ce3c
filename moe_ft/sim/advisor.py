"""Policy planner (``moe-ft plan``): rank policies and their knobs by predicted ETTR and say why."""

from __future__ import annotations

from dataclasses import dataclass

from moe_ft.sim.analytic import PolicyResult, choose_dense_interval, evaluate
from moe_ft.sim.costmodel import CostModel
from moe_ft.sim.policies import PolicySpec, _budget_bytes, parse_policy, selective_budgets
from moe_ft.sim.runflags import RunFlags, run_flags

CANDIDATES = ("dense", "gemini", "dense-daly", "checkfreq", "sparse", "sparse:localized=0", "pec:k=fit", "moc", "selective")


@dataclass(frozen=True)
class Recommendation:
    rank: int
    result: PolicyResult
    reason: str
    run: RunFlags
    """The launcher and ``--ft*`` flags that run what this row models."""


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def explain(cost: CostModel, result: PolicyResult, max_overhead: float = 0.03) -> str:
    """One sentence on what limits this policy here."""
    pm = result.model
    spec = pm.spec
    er = f"E[R] = {result.expected_recovery_s:.0f} s"
    restart = ("spares take the lost ranks, survivors keep their processes" if spec.launcher == "inprocess"
               else "every rank restarts")
    if spec.kind == "dense":
        cap = PolicySpec(kind="dense", label="cap", interval="cap", max_overhead=max_overhead, store=spec.store)
        try:
            need = f"needs interval ≥ {choose_dense_interval(cost, cap, result.mtbf_s)} to keep overhead ≤ {max_overhead:.0%}"
        except ValueError:
            need = f"cannot keep overhead ≤ {max_overhead:.0%} at any interval"
        return (f"dense ({spec.store}) {need}; a {_gb(pm.checkpoint_bytes)}/rank checkpoint takes "
                f"{pm.t_snapshot_s:.1f} s to land; chosen interval {result.interval} → overhead "
                f"{result.overhead:.1%}; global rollback, {restart}, {er} (restart + ½ interval + commit latency)")
    if spec.kind == "sparse":
        budget = _budget_bytes(cost)
        fits = "fits every iteration" if result.overhead == 0 else f"stalls {result.t_ckpt_s:.2f} s/iter"
        scope = (f"global rollback, {restart}" if not spec.localized else
                 "only the failed stage replays (MoEvement's localized restart)" if spec.localized_model == "paper"
                 else f"only the failed stage replays, {restart}, survivors reload their state")
        return (f"sparse W={result.window} {fits} (busiest iteration {_gb(pm.checkpoint_bytes)} vs budget "
                f"{_gb(budget)}/rank); {scope}, {er}")
    if spec.kind == "pec":
        return (f"PEC K={pm.knobs['k']} experts/layer per snapshot, overhead {result.overhead:.1%}; lossy: PLT ≈ "
                f"{result.plt:.2%} (MoC budget {spec.plt_budget:.2%}); global rollback, {restart}, {er}")
    local, remote = selective_budgets(pm.cost)
    fits = "within the budgets" if pm.checkpoint_bytes <= local else \
        "(the least the runtime saves; beyond the budget: it stalls)"
    k = pm.knobs
    return (f"selective: of {k['experts_per_rank']} experts per rank, {k['experts_per_iter']} saved and "
            f"{k['replicated_per_iter']} replicated per iteration {fits} ({_gb(local)} local, {_gb(remote)} remote), "
            f"overhead {result.overhead:.1%}; lossy: lost-update share ≈ {result.plt:.3%}; global rollback, "
            f"{restart}, {er}")


def plan(cost: CostModel, mtbf_s: float, policies: tuple[str, ...] = CANDIDATES,
         exact_only: bool = False) -> list[Recommendation]:
    """Evaluate the candidate policies at ``mtbf_s`` and rank them by ETTR (best first)."""
    results = [evaluate(cost, parse_policy(p), mtbf_s) for p in policies]
    if exact_only:
        results = [r for r in results if r.plt == 0.0 and r.kind in ("dense", "sparse")]
    results.sort(key=lambda r: r.ettr, reverse=True)
    return [Recommendation(i + 1, r, explain(cost, r), run_flags(r.model)) for i, r in enumerate(results)]
