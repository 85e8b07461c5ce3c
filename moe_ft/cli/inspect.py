"""``moe-ft inspect <store_dir> [--verify] [--json]``: list the recovery points of a node-local store
(the per-rank directory, e.g. ``/dev/shm/moe_ft/<job>/rank0``), their operators, levels and bytes, and with
``--verify`` checksum every entry. Exit code 0: healthy; 1: a damaged point or entry was found; 2: not a
store. Unpublished (in-flight or torn) points are listed but are not an error: they are never readable."""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter

from moe_ft.cli.errors import UsageError, reporting, user_input


def register(subparsers) -> None:
    parser = subparsers.add_parser("inspect", help="list and verify the recovery points of a node-local store",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store_dir", help="per-rank store directory (the one holding FORMAT.json)")
    parser.add_argument("--verify", action="store_true", help="read every entry and check its checksum")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--entries", action="store_true", help="list every entry, not only the per-point summary")
    parser.add_argument("--validate", action="store_true",
                        help="STORE_DIR is a durable tier (<persist_dir>/moe_ft/<job>): check that its newest complete "
                             "point verifies and holds every expert of every layer (needs --num-layers, --num-experts)")
    parser.add_argument("--num-layers", type=int, default=0, help="--validate: MoE layers of the model")
    parser.add_argument("--num-experts", type=int, default=0, help="--validate: experts per layer")
    parser.set_defaults(func=reporting("inspect", run))


def _human(size: int) -> str:
    n = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def _report(store, verify: bool) -> dict:
    catalog = store.verify() if verify else store.catalog()
    points = []
    for point in catalog.points():
        points.append({
            "iteration": point.iteration,
            "bytes": point.nbytes,
            "checksum": point.checksum_algo,
            "levels": dict(Counter(e.level.name for e in point.entries.values())),
            "meta": point.meta is not None,
            # FULL entries the owner only hashed, held by its replica peers (not fetched back here)
            "held_by_peers": sorted(str(op) for it, op in catalog.holes if it == point.iteration),
            "entries": [{"operator": str(e.op), "level": e.level.name, "bytes": e.nbytes, "checksum": e.checksum,
                         "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in e.tensors]}
                        for e in point.all_entries() if e.op is not None],
        })
    arena = getattr(store.backend, "arena_bytes", None)
    return {
        "store": store.backend.describe(),
        "layout": "files" if arena is None else "arena",
        "arena_bytes": arena,
        "verified": verify,
        "points": points,
        "unpublished": [{"iteration": s.iteration, "name": s.label, "bytes": s.nbytes, "writer_pid": s.writer_pid,
                         "writer_alive": s.live} for s in store.staging()],
        "problems": [{"iteration": p.iteration, "what": p.what, "reason": p.reason} for p in catalog.problems],
    }


def _print_text(report: dict, entries: bool) -> None:
    arena = "" if report["arena_bytes"] is None else f" (arena of {_human(report['arena_bytes'])})"
    print(f"store {report['store']}{arena}: {len(report['points'])} published point(s)"
          f"{', checksums verified' if report['verified'] else ''}")
    if report["points"]:
        print(f"{'iteration':>10} {'FULL':>6} {'COMPUTE':>8} {'meta':>5} {'bytes':>11}")
    for p in report["points"]:
        print(f"{p['iteration']:>10} {p['levels'].get('FULL', 0):>6} {p['levels'].get('COMPUTE', 0):>8} "
              f"{'yes' if p['meta'] else 'no':>5} {_human(p['bytes']):>11}")
        if p["held_by_peers"]:
            print(f"{'':>12}FULL state of {len(p['held_by_peers'])} operator(s) held by the replica peers "
                  f"(--ft-optimizer-recompute-local compute): {', '.join(p['held_by_peers'])}")
        if entries:
            for e in p["entries"]:
                shapes = ", ".join(f"{t['name']}:{t['dtype']}{t['shape']}" for t in e["tensors"])
                print(f"{'':>12}{e['operator']:<20} {e['level']:<8} {_human(e['bytes']):>10}  {shapes}")
    for s in report["unpublished"]:
        state = "in flight" if s["writer_alive"] else "torn, writer gone"  # arena: its regions are free again
        print(f"unpublished iteration {s['iteration']} ({state}, pid {s['writer_pid']}, {_human(s['bytes'])}): "
              f"invisible to readers")
    for p in report["problems"]:
        print(f"CORRUPT: iteration {p['iteration']} {p['what']}: {p['reason']}")
    if report["problems"]:
        print(f"{len(report['problems'])} problem(s); damaged entries are skipped by recovery")


def _validate(args: argparse.Namespace) -> int:
    # start-up time: `moe-ft` imports every subcommand module for --help; torch only when this command runs
    from moe_ft.persist.validate import validate_durable_points

    if args.num_layers < 1 or args.num_experts < 1:
        raise UsageError("--validate needs --num-layers and --num-experts (the model's), both >= 1")
    with user_input(OSError, ValueError):
        checked = validate_durable_points(args.store_dir, num_layers=args.num_layers, num_experts=args.num_experts)
    if not checked:
        raise UsageError(f"{args.store_dir}: no complete durable point")
    for end, problems in checked:
        for problem in problems:
            print(f"INVALID: point {end}: {problem}")
    end, problems = checked[-1]
    if problems:
        print(f"no complete durable point is valid ({len(checked)} checked): recovery cannot use the durable tier")
        return 1
    older = f"; recovery passes over the newer point(s) {[e for e, _ in checked[:-1]]} and uses this one" \
        if len(checked) > 1 else ""
    print(f"durable point ending at iteration {end}: every entry verified, "
          f"{args.num_layers} x {args.num_experts} experts present{older}")
    return 0


def run(args: argparse.Namespace) -> int:
    # start-up time: `moe-ft` imports every subcommand module for --help; torch only when this command runs
    from moe_ft.store import SnapshotStore, StoreError, open_backend

    logging.getLogger("moe_ft.store").setLevel(logging.ERROR)  # problems are reported below, once
    if args.validate:
        return _validate(args)
    with user_input(StoreError, OSError, ValueError):
        store = SnapshotStore(open_backend(args.store_dir, create=False))
    with user_input(OSError):  # an unreadable store directory; damaged entries are findings, not errors
        report = _report(store, args.verify)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print_text(report, args.entries)
    return 1 if report["problems"] else 0
