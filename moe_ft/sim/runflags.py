"""The command line each modelled policy stands for: ``moe-ft plan`` prints it under every row, so that what was
planned is what runs.

The knobs the model chose are given as fixed flags (a sparse window, a dense interval, PEC's K, selective's
budgets in bytes): the runtime derives windows and budgets from the iteration time it measures, which need not
be the model's ``T_iter``. Dense rows ask for ``--ft-recovery-scope global``: the model rolls every rank back
after a dense checkpoint (the runtime would localize the replay under pipeline parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_ft.sim.policies import PolicyModel, pec_model, selective_budgets

LAUNCHERS = {"inprocess": "moe-ft launch --spares-per-node 1", "torchrun": "torchrun"}
"""The launcher of each ``launcher=`` value (in-process recovery needs a spare per lost node)."""


@dataclass(frozen=True)
class RunFlags:
    """``launcher``: the command that starts the job; ``flags``: the ``--ft*`` flags of ``pretrain_gpt_moe.py``
    (``None``: the model is a paper's, which moe-ft does not run, with the reason in ``note``)."""

    launcher: str
    flags: tuple[str, ...] | None
    note: str = ""

    def __str__(self) -> str:
        if self.flags is None:
            return self.note
        return f"{self.launcher} … pretrain_gpt_moe.py … {' '.join(self.flags)}"


def run_flags(pm: PolicyModel) -> RunFlags:
    """The launcher and ``--ft*`` flags that run what ``pm`` models."""
    spec, cost = pm.spec, pm.cost
    launcher = LAUNCHERS[spec.launcher]
    replicas = ("--ft-replicas", str(cost.config.recovery.replicas))
    if spec.kind == "sparse":
        if spec.localized and spec.localized_model == "paper":
            return RunFlags(launcher, None, "MoEvement's localized restart: a paper model, not what moe-ft runs "
                                            "(moe-ft's own is the row without localized=paper)")
        scope = () if spec.localized else ("--ft-recovery-scope", "global")
        return RunFlags(launcher, ("--ft", "--ft-policy", "sparse", "--ft-sparse-window", str(pm.period_iters),
                                   *replicas, *scope))
    if spec.kind == "dense":
        flags = ("--ft", "--ft-policy", "dense", "--ft-dense-interval", str(pm.period_iters))
        if spec.store == "storage":
            return RunFlags(launcher, (*flags, "--ft-replicas", "0", "--ft-persist-interval", str(pm.period_iters),
                                       "--ft-persist-dir", "DIR", "--ft-recovery-scope", "global"))
        return RunFlags(launcher, (*flags, *replicas, "--ft-recovery-scope", "global"))
    if spec.kind == "pec":
        if spec.k == "dynamic":  # the runtime starts at --ft-pec-k; Dynamic-K doubles it after recoveries
            k = spec.k0 or pec_model(cost, spec).knobs["k"]
            return RunFlags(launcher, ("--ft", "--ft-policy", "pec", "--ft-pec-k", str(k), *replicas))
        return RunFlags(launcher, ("--ft", "--ft-policy", "pec", "--ft-pec-k", str(pm.knobs["k"]), "--ft-pec-fixed-k",
                                   *replicas))
    local, remote = selective_budgets(cost)
    return RunFlags(launcher, ("--ft", "--ft-policy", "selective", "--ft-selective-local-budget", str(int(local)),
                               "--ft-selective-remote-budget", str(int(remote)), *replicas))
