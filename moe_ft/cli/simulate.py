"""``moe-ft simulate`` and ``moe-ft plan``: ETTR model, failure simulator and policy planner.

    moe-ft simulate --preset deepseek-moe-16b --mtbf 10m,30m,1h,2h
    moe-ft simulate --config my.json --mtbf 20m --policies gemini sparse --json --csv out.csv --plot out.png
    moe-ft simulate --preset deepseek-moe-16b --trace failures.csv --mtbf 19m
    moe-ft plan --preset deepseek-v3-671b --mtbf 30m
    moe-ft plan --preset deepseek-moe-16b --mtbf 30m --set hardware.host_s_per_byte=0 --set hardware.host_s_per_snapshot=0.016

Config file format and the model's assumptions: docs/simulator.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from moe_ft.cli.errors import reporting, user_input

DEFAULT_POLICIES = ["checkfreq", "gemini", "moc", "selective", "sparse"]


def _add_common(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", metavar="FILE", help="JSON config (model, parallel, precision, hardware, recovery)")
    src.add_argument("--preset", metavar="NAME", help="a named paper setting (see --list-presets)")
    p.add_argument("--list-presets", action="store_true", help="print the preset names and exit")
    p.add_argument("--mtbf", nargs="+", default=["10m", "30m", "1h", "2h"],
                   help="job MTBF values: 600, 10m, 1h (space- or comma-separated)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="change one field of the config or preset (repeatable; VALUE is JSON), e.g. "
                        "--set hardware.host_s_per_byte=0 --set hardware.host_s_per_snapshot=0.016")


def register(subparsers) -> None:
    sim = subparsers.add_parser("simulate", help="predict and simulate ETTR per checkpointing policy",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_common(sim)
    sim.add_argument("--policies", nargs="+", default=DEFAULT_POLICIES,
                     help="policies: dense[:interval=N|oracle|daly|cap][:store=memory|storage], sparse"
                          "[:localized=0|paper], pec[:k=N|fit|dynamic], selective, each with [:launcher=inprocess|"
                          "torchrun], or gemini, checkfreq, dense-daly, moc")
    sim.add_argument("--hours", type=float, default=12.0, help="simulated run length (default 12, as MoEvement §5.2)")
    sim.add_argument("--seed", type=int, default=0, help="seed of the failure process")
    sim.add_argument("--trace", metavar="CSV", help="replay a failure trace (header time_s,nodes) instead of Poisson")
    sim.add_argument("--spot-prob", type=float, metavar="P",
                     help="spot preemptions instead of Poisson: per-node probability per hour (Lazarus §6.7)")
    sim.add_argument("--analytic-only", action="store_true", help="skip the event simulation")
    sim.add_argument("--csv", metavar="FILE", help="also write one CSV row per (MTBF, policy)")
    sim.add_argument("--plot", metavar="PNG", help="also plot ETTR vs MTBF per policy (needs matplotlib)")
    sim.set_defaults(func=reporting("simulate", run_simulate))

    pl = subparsers.add_parser("plan", help="rank checkpointing policies and knobs by predicted ETTR")
    _add_common(pl)
    pl.add_argument("--exact-only", action="store_true", help="only policies that lose no updates")
    pl.set_defaults(func=reporting("plan", run_plan))


def _load(args):
    # start-up time: the simulator imports the policies package (torch); `moe-ft --help` stays free of it
    from moe_ft.sim.config import load_config, with_overrides
    from moe_ft.sim.costmodel import CostModel
    from moe_ft.sim.presets import build_presets, get_preset
    from moe_ft.sim.report import parse_duration

    if args.list_presets:
        for name, cfg in build_presets().items():
            print(f"{name:40s} {cfg.model.name} on {cfg.parallel.world_size} GPUs ({cfg.hardware.name})")
        return None
    if not (args.config or args.preset):
        raise ValueError("give --config FILE or --preset NAME (see --list-presets)")
    cfg = with_overrides(load_config(args.config) if args.config else get_preset(args.preset), args.set)
    mtbfs = [parse_duration(x) for item in args.mtbf for x in item.split(",") if x.strip()]
    if not mtbfs:
        raise ValueError("--mtbf needs at least one value")
    return CostModel(cfg), mtbfs


def writable_file(flag: str, path: str) -> None:
    """``ValueError`` naming ``flag`` unless ``path`` can be written as a file: not a directory, its parent
    an existing directory (checked before the simulation runs, which may take minutes)."""
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; give a file name, e.g. {os.path.join(path, 'ettr')}"
                         f"{'.png' if flag == '--plot' else '.csv'}")
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: No such file or directory ({parent} is not a directory); create it first")


def run_simulate(args) -> int:
    # start-up time: the simulator imports the policies package (torch); `moe-ft --help` stays free of it
    from moe_ft.sim.analytic import evaluate
    from moe_ft.sim.failures import load_trace, poisson_failures, spot_failures
    from moe_ft.sim.policies import parse_policy
    from moe_ft.sim.report import format_table, to_json_obj, write_csv, write_plot
    from moe_ft.sim.simulator import Simulator, num_nodes

    # bad flags, unreadable or invalid config/trace files, unwritable --csv/--plot: one line, exit 2
    with user_input(ValueError, RuntimeError, OSError):
        loaded = _load(args)
        if loaded is None:
            return 0
        cost, mtbfs = loaded
        specs = [parse_policy(p) for item in args.policies for p in item.split(",") if p.strip()]
        if not specs:
            raise ValueError("--policies names no policy; give at least one, e.g. --policies sparse gemini")
        if not math.isfinite(args.hours) or args.hours <= 0:
            raise ValueError(f"--hours must be a finite number of hours > 0, got {args.hours}")
        if args.seed < 0:
            raise ValueError(f"--seed must be >= 0, got {args.seed}")
        if args.spot_prob is not None and not 0 <= args.spot_prob <= 1:
            raise ValueError(f"--spot-prob is a per-node probability per hour, in [0, 1]; got {args.spot_prob}")
        horizon = args.hours * 3600
        nodes = num_nodes(cost)
        trace = load_trace(args.trace, nodes) if args.trace else None
        for flag, path in (("--csv", args.csv), ("--plot", args.plot)):
            if path:  # before the simulation, not after it
                writable_file(flag, path)
        rows = {}
        for mtbf in mtbfs:
            if trace is not None or args.analytic_only:
                events = trace or []
            elif args.spot_prob is not None:
                events = spot_failures(args.spot_prob, horizon, nodes, args.seed)
            else:
                events = poisson_failures(mtbf, horizon, nodes, args.seed)
            rows[mtbf] = [(evaluate(cost, s, mtbf),
                           None if args.analytic_only else Simulator(cost, s, mtbf).run(events, horizon))
                          for s in specs]
        if args.csv:
            write_csv(args.csv, rows)
        if args.plot:
            write_plot(args.plot, cost.config.name, rows)
    it = cost.iteration
    meta = {"world_size": cost.config.parallel.world_size, "total_params": cost.total_params(),
            "t_iter_s": it.t_iter_s, "t_pipeline_s": it.t_pipeline_s, "horizon_s": horizon,
            "failures": "trace" if trace is not None else ("spot" if args.spot_prob is not None else "poisson")}
    if args.json:
        print(json.dumps(to_json_obj(cost.config.name, rows, meta), indent=1))
    else:
        print(f"{cost.config.parallel.world_size} GPUs, {cost.total_params() / 1e9:.1f}B params, T_iter "
              f"{it.t_iter_s:.2f} s (pipeline {it.t_pipeline_s:.2f}, sync {it.t_sync_s:.2f}, update "
              f"{it.t_update_s:.3f}); {args.hours:g} h simulated, seed {args.seed}")
        print(format_table(cost.config.name, rows))
    return 0


def run_plan(args) -> int:
    # start-up time: the simulator imports the policies package (torch); `moe-ft --help` stays free of it
    from moe_ft.sim.advisor import plan

    with user_input(ValueError, RuntimeError, OSError):
        loaded = _load(args)
        if loaded is None:
            return 0
        cost, mtbfs = loaded
        out = {}
        for mtbf in mtbfs:
            out[mtbf] = plan(cost, mtbf, exact_only=args.exact_only)
    from moe_ft.sim.report import format_duration, row_dict  # start-up time: see above

    if args.json:
        print(json.dumps({format_duration(m): [{"rank": r.rank, "policy": r.result.policy, "reason": r.reason,
                                                 "launcher": r.run.launcher, "flags": r.run.flags,
                                                 **row_dict(r.result, None)} for r in recs]
                          for m, recs in out.items()}, indent=1))
        return 0
    for mtbf, recs in out.items():
        print(f"MTBF {format_duration(mtbf)} ({cost.config.name}):")
        for r in recs:
            print(f"  {r.rank}. {r.result.policy:<20} ETTR {r.result.ettr:.3f}  {r.reason}")
            print(f"     run: {r.run}")
    return 0
