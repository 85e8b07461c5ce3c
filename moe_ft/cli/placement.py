"""``moe-ft placement``: Lazarus allocation (eq. 1), placement plan and exact recovery probabilities.

    moe-ft placement --loads 40,30,20,10 --nodes 5 --slots 4 --f 1 --failed 3 [--strategy optimal] [--json]
"""

from __future__ import annotations

import argparse
import json
import math

from moe_ft.cli.errors import reporting, user_input
from moe_ft.placement.layers import ExpertPlacementConfig, plan_layer
from moe_ft.placement.reliability import ReliabilityConfig, recovery_probabilities
from moe_ft.placement.search import SearchConfig


def _loads(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--loads must be comma-separated numbers, got {text!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"--loads must be finite numbers (tokens per expert), got {text!r}")
    return [int(v) if v.is_integer() else v for v in values]


STRATEGY_HELP = ("placement strategy: optimal (default: the exact search), mro (maximum rank overlap, Lazarus "
                 "§4.1), spread or compact (baselines)")


def register(subparsers) -> None:
    p = subparsers.add_parser("placement", help="expert replica allocation and fault-tolerant placement (Lazarus)")
    p.add_argument("--loads", type=_loads, required=True, help="tokens routed to each expert, e.g. 40,30,20,10")
    p.add_argument("--nodes", type=int, required=True, help="number of nodes N")
    p.add_argument("--slots", type=int, required=True, help="expert replicas per node c")
    p.add_argument("--f", type=int, default=1, help="fault-tolerance threshold: replicas per expert at least (default 1)")
    p.add_argument("--failed", type=int, default=None, help="report only this number of failed nodes (default: all)")
    # no argparse choices: they would import the planner (numpy) for every --help; ExpertPlacementConfig checks it
    p.add_argument("--strategy", default="optimal", help=STRATEGY_HELP)
    p.add_argument("--seed", type=int, default=0, help="Monte-Carlo seed, used only when no exact method fits")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=reporting("placement", run))


def run(args: argparse.Namespace) -> int:
    with user_input(ValueError):
        if args.failed is not None and not 0 <= args.failed <= args.nodes:
            raise ValueError(f"--failed must be in [0, {args.nodes}] (the number of nodes), got {args.failed}")
        config = ExpertPlacementConfig(
            slots_per_node=args.slots,
            min_replicas=args.f,
            strategy=args.strategy,
            search=SearchConfig(target_failures=args.failed),
        )
        layer = plan_layer(args.loads, args.nodes, config)
        failed = [args.failed] if args.failed is not None else list(range(args.nodes + 1))
        probs = recovery_probabilities(layer.plan, len(args.loads), failed, ReliabilityConfig(seed=args.seed))
    if args.json:
        print(json.dumps({
            "allocation": list(layer.allocation),
            "plan": [list(node) for node in layer.plan],
            "recovery_probability": {str(k): est.probability for k, est in probs.items()},
        }))
        return 0
    print(f"allocation (replicas per expert, in the order given): {list(layer.allocation)}")
    print(f"plan ({args.strategy}):")
    for n, node in enumerate(layer.plan):
        print(f"  node {n}: {list(node)}")
    print("recovery probability:")
    for k, est in probs.items():
        exact = f" = {est.exact}" if est.exact is not None else f" (95% CI {est.ci_low:.4f}..{est.ci_high:.4f})"
        print(f"  {k} failed: {est.probability:.6f}{exact}  [{est.method}]")
    return 0
