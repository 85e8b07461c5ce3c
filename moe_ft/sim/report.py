"""Output of ``moe-ft simulate``: text table, JSON object, CSV rows and an ETTR-vs-MTBF plot."""

from __future__ import annotations

import csv
import math

from moe_ft.sim.analytic import PolicyResult
from moe_ft.sim.simulator import SimResult

try:  # optional: only --plot needs it; the backend is chosen when plotting, not at import
    import matplotlib

    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def format_duration(seconds: float) -> str:
    if seconds % 3600 == 0:
        return f"{int(seconds // 3600)}h"
    if seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    return f"{seconds:g}s"


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``1.5h`` → seconds."""
    text = text.strip().lower()
    scale = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
    try:
        if text and text[-1] in scale:
            value = float(text[:-1]) * scale[text[-1]]
        else:
            value = float(text)
    except ValueError:
        raise ValueError(f"cannot parse duration {text!r}; use e.g. 600, 10m, 1h") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"duration must be a finite number > 0, got {text!r}; use e.g. 600, 10m, 1h")
    return value


Row = tuple[PolicyResult, SimResult | None]


def row_dict(res: PolicyResult, sim: SimResult | None) -> dict:
    d = {"ettr": res.ettr, "ettr_first_order": res.ettr_first_order, "interval": res.interval,
         "window": res.window, "t_iter": res.t_iter_s, "t_ckpt": res.t_ckpt_s, "t_snapshot": res.t_snapshot_s,
         "overhead": res.overhead, "expected_recovery_s": res.expected_recovery_s, "plt": res.plt,
         "checkpoint_bytes_per_rank": res.checkpoint_bytes, "knobs": res.knobs}
    if sim is not None:
        d["simulated"] = sim.to_dict()
    return d


def to_json_obj(config_name: str, rows: dict[float, list[Row]], meta: dict) -> dict:
    return {"config": config_name, **meta,
            "results": {format_duration(m): {r.policy: row_dict(r, s) for r, s in rs} for m, rs in rows.items()}}


def _knobs(r: PolicyResult) -> str:
    if r.kind == "sparse":
        return f"W={r.window}"
    if r.kind == "dense":
        return f"k={r.interval}"
    if r.kind == "selective":  # experts saved, replicated, of a rank's (the stalest stage)
        return f"S={r.knobs['experts_per_iter']} rep={r.knobs['replicated_per_iter']}/{r.knobs['experts_per_rank']}"
    return ",".join(f"{k}={v}" for k, v in r.knobs.items())


def format_table(config_name: str, rows: dict[float, list[Row]]) -> str:
    head = (f"{'MTBF':>5} {'policy':<28} {'knobs':<16} {'T_iter':>7} {'T_ckpt':>7} {'ovh':>6} {'E[R]':>7} "
            f"{'ETTR':>6} {'sim':>6} {'fails':>5} {'lost: ckpt/restart/recompute (s)':>34}")
    lines = [f"config: {config_name}", head, "-" * len(head)]
    for mtbf, rs in rows.items():
        for r, s in sorted(rs, key=lambda x: -x[0].ettr):
            knobs = _knobs(r)
            sim = f"{s.ettr:6.3f} {s.num_failures:5d} " + "/".join(
                f"{s.lost_s[c]:.0f}" for c in ("checkpoint", "restart", "recompute")).rjust(34) if s else ""
            lines.append(f"{format_duration(mtbf):>5} {r.policy:<28} {knobs:<16} {r.t_iter_s:7.2f} {r.t_ckpt_s:7.2f} "
                         f"{r.overhead:6.1%} {r.expected_recovery_s:7.1f} {r.ettr:6.3f} {sim}")
    return "\n".join(lines)


def write_csv(path: str, rows: dict[float, list[Row]]) -> None:
    fields = ["mtbf_s", "policy", "interval", "window", "t_iter", "t_ckpt", "overhead", "expected_recovery_s",
              "ettr", "ettr_first_order", "plt", "sim_ettr", "sim_failures", "sim_lost_checkpoint_s",
              "sim_lost_restart_s", "sim_lost_recompute_s"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for mtbf, rs in rows.items():
            for r, s in rs:
                w.writerow({"mtbf_s": mtbf, "policy": r.policy, "interval": r.interval, "window": r.window,
                            "t_iter": r.t_iter_s, "t_ckpt": r.t_ckpt_s, "overhead": r.overhead,
                            "expected_recovery_s": r.expected_recovery_s, "ettr": r.ettr,
                            "ettr_first_order": r.ettr_first_order, "plt": r.plt,
                            "sim_ettr": s.ettr if s else "", "sim_failures": s.num_failures if s else "",
                            "sim_lost_checkpoint_s": s.lost_s["checkpoint"] if s else "",
                            "sim_lost_restart_s": s.lost_s["restart"] if s else "",
                            "sim_lost_recompute_s": s.lost_s["recompute"] if s else ""})


def write_plot(path: str, config_name: str, rows: dict[float, list[Row]]) -> None:
    """ETTR vs MTBF per policy (analytic line, simulated markers) as a PNG."""
    if not HAVE_MATPLOTLIB:
        raise RuntimeError("--plot needs matplotlib: pip install 'moe-ft[plot]' (or pip install matplotlib)")
    matplotlib.use("Agg")
    # optional dependency: matplotlib (the [plot] extra), only for --plot
    import matplotlib.pyplot as plt

    mtbfs = sorted(rows)
    policies = [r.policy for r, _ in rows[mtbfs[0]]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for p in policies:
        pts = [(m, r, s) for m in mtbfs for r, s in rows[m] if r.policy == p]
        line, = ax.plot([m / 60 for m, _, _ in pts], [r.ettr for _, r, _ in pts], label=p)
        sims = [(m / 60, s.ettr) for m, _, s in pts if s is not None]
        if sims:
            ax.scatter(*zip(*sims), color=line.get_color(), marker="x")
    ax.set_xscale("log")
    ax.set_xlabel("MTBF (minutes)")
    ax.set_ylabel("ETTR")
    ax.set_title(f"{config_name}: analytic (lines), simulated (x)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
