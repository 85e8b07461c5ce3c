"""Global replay vs localized recovery on PP=4 (MoEvement §3.4, Fig. 9b), and the full restart vs the
in-process one, in one run.

    python tools/bench/recovery.py [--model {tiny,medium}] [--iters 12] [--window 4] [--fail 2:10] [--json]

The same fault is also recovered under ``moe-ft launch`` with one warm spare (``inprocess``: the
survivors keep their processes, the spare takes the failed rank, ``moe_ft/launch/``), localized scope;
``kill_to_resume_s`` (the SIGKILL to the moment every rank starts its first resumed iteration) is reported
for every run, and ``inprocess_speedup`` is the torchrun localized run's over the in-process one's.

Three ``torchrun`` launches of the same 4-rank job (PP=4, 1F1B, one layer per stage, sparse snapshots of
window ``W``): fault-free, then the same SIGKILL of one stage (``--fail RANK:ITER``, default stage 2 at
the start of iteration 10) recovered once with ``--ft-recovery-scope global`` (every rank restores its
window and replays it, then the loop re-executes the lost iterations on every stage) and once with
``localized`` (survivors load the state they published, only the failed stage replays, fed by its
neighbours' upstream logs). Both recoveries must end bitwise equal to the fault-free run.

Per scope, from the recovery reports (``moe_ft/recovery/report.py``):

* ``stage_iterations``: iterations replayed or re-executed, summed over stages (global: every stage the
  window's replay plus the lost iterations; localized: the failed stage's window and lost iterations);
* ``recovery_s``: wall seconds from the start of recovery in the restarted job until the job is back at
  the iteration it had reached (global: in-job recovery + re-execution of the lost iterations; localized:
  in-job recovery, which includes them); ``restart_s``: from the SIGKILL to the start of recovery (torchrun
  detection, restart, imports, model build: the same for both scopes, every rank restarts);
* ``bytes_read``: bytes read from node-local stores, all ranks (snapshot windows, survivor points) plus
  upstream-log bytes moved to the replaying stage.

``--model medium`` (hidden 256, 8 experts, seq 128) makes an iteration ~10x heavier than ``tiny`` so that
replay, not fixed costs, dominates; on the 2-core CPU machine expect ~3-4 min for it, ~1.5 min for tiny.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

MEDIUM = ["--hidden-size", "256", "--ffn-hidden-size", "512", "--seq-length", "128", "--max-position-embeddings",
          "128", "--num-experts", "8"]


def summarize(report: dict, scope: str) -> dict:
    sc = report["scope"]
    secs = report["seconds"]
    if scope == "global":
        per_stage = len(report["replayed_iterations"]) + len(report["reexecuted_iterations"])
        stage_iterations = 4 * per_stage
        recovery_s = secs["total"] + secs.get("reexecute", 0.0)
        bytes_read = sum(sc["bytes_loaded"].values())
    else:
        stage_iterations = sc["stage_iterations_replayed"] + 4 * len(report["reexecuted_iterations"])
        recovery_s = secs["total"] + secs.get("reexecute", 0.0)
        bytes_read = sum(sc["bytes_loaded"].values()) + sum(sc["log_bytes_read"].values())
    return {"mode": sc["mode"], "reason": sc["reason"], "stage_iterations": stage_iterations,
            "recovery_s": round(recovery_s, 3), "restart_s": round(secs.get("restart", float("nan")), 2),
            "kill_to_resume_s": secs.get("kill_to_resume"), "restart_kind": report.get("restart_kind"),
            "survivor_pids_kept": report.get("survivor_pids_kept"),
            "bytes_read": bytes_read, "seconds": secs, "seconds_per_rank": sc.get("seconds", {}),
            "replayed": sc.get("replayed") or {"every rank": report["replayed_iterations"]},
            "reexecuted": report["reexecuted_iterations"]}


def main(argv=None) -> int:
    from moe_ft.cli.drill import ensure_corpus, run_job

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["tiny", "medium"], default="tiny")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--fail", default="2:10", help="RANK:ITER[:PHASE] of the fault (default: stage 2, iteration 10)")
    p.add_argument("--workdir", default="")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    work = args.workdir or tempfile.mkdtemp(prefix="moe_ft_bench_recovery_")
    store = os.path.join("/dev/shm", f"moe_ft_bench_recovery_{os.getpid()}")
    data = ensure_corpus(work)
    extra = MEDIUM if args.model == "medium" else []
    common = dict(workdir=work, timeout=900, layout="pp4", policy="sparse", iters=args.iters, data=data,
                  store=store, window=args.window, extra=extra)
    t0 = time.time()
    ref = run_job(job="faultfree", **common)
    if ref["rc"] != 0 or not ref["digest"]:
        raise SystemExit(f"fault-free run failed, see {ref['log']}")
    out = {"model": args.model, "iters": args.iters, "window": args.window, "fail": args.fail}
    runs = {"global": ("global", "torchrun"), "localized": ("localized", "torchrun"),
            "inprocess": ("localized", "inprocess")}
    for name, (scope, launcher) in runs.items():
        res = run_job(job=name, faults=[args.fail], max_restarts=2, scope=scope, launcher=launcher, **common)
        if res["rc"] != 0 or len(res["reports"]) != 1:
            raise SystemExit(f"{name} run failed (rc {res['rc']}, {len(res['reports'])} reports), see {res['log']}")
        out[name] = dict(summarize(res["reports"][0], scope), launcher=launcher,
                         bitwise_equal=res["digest"] == ref["digest"])
    g, loc, inp = out["global"], out["localized"], out["inprocess"]
    out["inprocess_speedup"] = round(loc["kill_to_resume_s"] / inp["kill_to_resume_s"], 2)
    out["recovery_time_change"] = round(loc["recovery_s"] / g["recovery_s"] - 1.0, 3)
    out["stage_iterations_change"] = round(loc["stage_iterations"] / g["stage_iterations"] - 1.0, 3)
    out["wall_s"] = round(time.time() - t0, 1)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for name in runs:
            r = out[name]
            print(f"{name:9s} stage-iterations {r['stage_iterations']:3d}  recovery {r['recovery_s']:.3f} s  "
                  f"restart {r['restart_s']:.1f} s  kill-to-resume {r['kill_to_resume_s']:.2f} s  "
                  f"bytes read {r['bytes_read'] / 1e6:.2f} MB  "
                  f"bitwise {r['bitwise_equal']}  replayed {r['replayed']}  re-executed {r['reexecuted']}")
        print(f"localized vs global: recovery time {100 * out['recovery_time_change']:+.0f} %, stage-iterations "
              f"{100 * out['stage_iterations_change']:+.0f} %")
        print(f"in-process (moe-ft launch, 1 spare) vs torchrun, localized: kill-to-resume "
              f"{out['inprocess_speedup']:.1f}x faster, survivor pids kept {inp['survivor_pids_kept']}")
    import shutil

    shutil.rmtree(store, ignore_errors=True)
    return 0 if g["bitwise_equal"] and loc["bitwise_equal"] and inp["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
