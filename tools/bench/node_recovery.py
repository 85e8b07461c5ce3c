"""A lost node: a replacement node under torchrun's agent vs warm spares on the surviving node, or a
replacement node with the survivors kept, under ``moe-ft launch``, side by side in one run.

    python tools/bench/node_recovery.py [--layout dp2ep2] [--iters 10] [--window 4] [--loss 1:6] [--json]

One fault-free run of the 4-rank job (``--standalone``), then the same node loss three times on 2 simulated
nodes x 2 ranks (``moe_ft/drills/cluster.py``: one agent per node on a c10d rendezvous the driver hosts,
each node with its own store; the lost node's agent and workers are SIGKILLed at once and its store is
deleted):

* ``torchrun``: plain torchrun (every worker a fresh interpreter, as users launch it). The
  surviving node's workers fail, its agent restarts them, and a replacement agent joins; the replacement's
  ranks fetch their state from the survivor's replicas.
* ``inprocess``: ``moe-ft launch --spares-per-node 2 --node-timeout T``. The surviving node's agent sees the
  lost node's heartbeat stop after ``T`` seconds and gives its ranks to its two warm spares; the surviving
  workers keep their processes; no replacement node starts.
* ``replacement``: ``moe-ft launch --spares-per-node 0`` (a fixed ``--nnodes 2``, no spare anywhere). The
  surviving node's agent announces that the lost ranks wait for a replacement node; its workers keep their
  processes and wait; the replacement agent joins the rendezvous and starts ranks 2, 3, which fetch their
  state from the survivor's replicas.

All three must end bitwise equal to the fault-free run. Reported per launcher, from the recovery report
(``moe_ft/recovery/report.py``) and the driver's loss event: ``kill_to_resume_s`` (the SIGKILL to the
moment every rank starts its first resumed iteration), ``detect_s``/``reform_s`` (in-process: the kill to
the agent's announcement, then to every rank having its groups and model), ``recovery_s`` (in-job
recovery), ``restart_kind``, ``survivor_pids_kept`` and the agent launches per node. ``inprocess_speedup``
(``replacement_speedup``) is the torchrun run's kill-to-resume over the in-process (replacement) one's; the
replacement's includes the drill driver's start of the new agent and its workers' imports. The in-process detection is bounded below
by ``--node-timeout`` (the heartbeat); the torchrun path detects the dead peers at once but restarts every
process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

LAUNCHERS = {"torchrun": ("torchrun", ()), "inprocess": ("inprocess", ("--spares-per-node=2",)),
             "replacement": ("inprocess", ("--spares-per-node=0",))}


def main(argv=None) -> int:
    from moe_ft.cli.drill import ensure_corpus, node_flags, run_job, run_node_job
    from moe_ft.drills.cluster import NodeLoss

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", default="dp2ep2", choices=["dp2ep2", "ep2pp2"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--loss", default="1:6", help="NODE:ITER[:PHASE] of the node loss (default: node 1, iteration 6)")
    p.add_argument("--workdir", default="")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="moe_ft_bench_node_")
    store = os.path.join("/dev/shm", f"moe_ft_bench_node_{os.getpid()}")
    data = ensure_corpus(work)
    loss = NodeLoss.parse(args.loss)
    common = dict(layout=args.layout, policy="sparse", iters=args.iters, data=data, window=args.window)
    ref_flags = ["--ft-replicas", "1", "--ft-ranks-per-node", "2"]  # the same job the node runs train
    t0 = time.time()
    ref = run_job(job="faultfree", workdir=work, timeout=600, store=os.path.join(store, "faultfree"),
                  launcher="preloaded", extra=ref_flags, **common)
    if ref["rc"] != 0 or not ref["digest"]:
        raise SystemExit(f"fault-free run failed, see {ref['log']}")
    out: dict = {"layout": args.layout, "iters": args.iters, "window": args.window, "loss": args.loss}
    for name, (launcher, flags) in LAUNCHERS.items():
        job_dir = os.path.join(work, name)
        os.makedirs(job_dir)
        extra = node_flags(nodes=2, losses=[loss], faults=[], work=job_dir, window=args.window)
        res = run_node_job(job=name, workdir=job_dir, faults=[], losses=[loss], num_nodes=2, max_restarts=2,
                           timeout=600, launcher=launcher, launcher_flags=flags, store=os.path.join(store, name),
                           extra=extra, **common)
        if res["rc"] != 0 or len(res["reports"]) != 1:
            raise SystemExit(f"{name} run failed (rc {res['rc']}, {len(res['reports'])} reports), see {res['logs']}")
        report, (event,) = res["reports"][0], res["node_losses"]
        secs = report["seconds"]
        out[name] = {"launcher": launcher, "flags": list(flags), "bitwise_equal": res["digest"] == ref["digest"],
                     "kill_to_resume_s": secs.get("kill_to_resume"), "detect_s": secs.get("detect"),
                     "reform_s": secs.get("reform"), "recovery_s": secs.get("total"),
                     "restart_kind": report["restart_kind"], "survivor_pids_kept": report["survivor_pids_kept"],
                     "replaced": event["replaced"], "launches": res["launches"],
                     "recovery_point": {k: report["recovery_point"][k] for k in ("source", "start", "end", "resume")}}
    tr = out["torchrun"]
    for name in ("inprocess", "replacement"):
        if tr["kill_to_resume_s"] and out[name]["kill_to_resume_s"]:
            out[f"{name}_speedup"] = round(tr["kill_to_resume_s"] / out[name]["kill_to_resume_s"], 2)
    out["wall_s"] = round(time.time() - t0, 1)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for name in LAUNCHERS:
            r = out[name]
            print(f"{name:9s} kill-to-resume {r['kill_to_resume_s']} s  detect {r['detect_s']}  reform "
                  f"{r['reform_s']}  recovery {r['recovery_s']} s  {r['restart_kind']}, survivor pids kept "
                  f"{r['survivor_pids_kept']}, agents per node {r['launches']}, bitwise {r['bitwise_equal']}")
        print(f"vs torchrun with a replacement node, kill-to-resume: moe-ft launch with 2 spares per node "
              f"{out.get('inprocess_speedup', 'n/a')}x, moe-ft launch with a replacement node "
              f"{out.get('replacement_speedup', 'n/a')}x")
    shutil.rmtree(store, ignore_errors=True)
    return 0 if all(out[name]["bitwise_equal"] for name in LAUNCHERS) else 1


if __name__ == "__main__":
    sys.exit(main())
