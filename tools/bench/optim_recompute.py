"""Bytes on the wire for the selected experts with and without asynchronous optimizer recomputation
(MoEtion §5.2, Algorithm 3; ``--ft-optimizer-recompute``), on a CPU model.

    python tools/bench/optim_recompute.py [--model {tiny,medium}] [--experts {all,part}] [--iters N]
                                          [--local {full,compute,both}] [--json]

Runs ``pretrain_gpt_moe.py`` once with ``torchrun`` (4 ranks, EP=2 x PP=2, two simulated nodes of 2 ranks,
one replica per rank on the other node, ``--ft-policy selective``, 1 thread each). One run gives both
numbers exactly: every replicated point records the FULL expert entries it sent and, for the experts it
sent as gradients, both the gradient bytes and the bytes of the FULL entries they stand for (entry sizes
are deterministic), so ``without`` = FULL sent + FULL replaced, ``with`` = FULL sent + gradients.

``--experts all``: a budget that saves every expert every iteration (one stable period: the upper bound of
the saving); ``part`` (medium only): 6 of each rank's 8 experts, selected by tokens since their last FULL
snapshot (MoEtion §4.3), so experts enter and leave the selection (tiny has 2 experts per rank: 1 of 2
alternates and never continues a period). Reported per rank: points, experts sent as gradients / as FULL,
expert bytes per point without and with Algorithm 3, their ratio, and the seconds the rank spent replaying
its sources' optimizer steps (on its receiver thread).

``--local`` (default ``both``: two runs, side by side): what the owner snapshots of an expert it sends as
gradients, ``full`` (its FULL state, as well) or ``compute`` (only its compute weights and a checksum of
the FULL state; the peer holds the FULL state). Per rank and point: MB the owner's snapshots wrote, MB they
only hashed for the peers, and the snapshot engine thread's CPU time.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tools.bench.ckpt_overhead import MODELS  # noqa: E402  (the same tiny and medium models)

BUDGETS = {  # bytes per rank per iteration for --ft-selective-local-budget
    ("tiny", "all"): 10**12,
    ("medium", "all"): 10**12,
    # non-expert FULL state (7.56-7.95 MB per rank) + 6.5 expert FULL entries (6.29 MB each): 6 of 8 experts
    ("medium", "part"): 48_800_000,
}
LINE = re.compile(r"optimizer recomputation rank (\d+): (\d+) points sent (\d+) experts as gradients \(([\d.]+) MB "
                  r"for ([\d.]+) MB of FULL state\) and (\d+) as FULL \(([\d.]+) MB\), capture ([\d.]+) s; "
                  r"recomputed (\d+) for its "
                  r"sources in ([\d.]+) s, (\d+) failed")
OWNER = re.compile(r"optimizer recomputation rank (\d+): .*?(?:compute weights only for (\d+) expert snapshots, (\d+) "
                   r"lost; )?snapshots wrote ([\d.]+) MB, hashed ([\d.]+) MB for the peers, engine thread ([\d.]+) s CPU "
                   r"\(([\d.]+) s on entries\)")


def parse(stdout: str) -> dict:
    out = {}
    for m in LINE.finditer(stdout):
        rank, points, n_grad, grad_mb, replaced_mb, n_full, full_mb, capture, recomputed, seconds, failed = m.groups()
        points = int(points)
        without = (float(full_mb) + float(replaced_mb)) / max(points, 1)
        with_ = (float(full_mb) + float(grad_mb)) / max(points, 1)
        out[int(rank)] = {"points": points, "experts_as_gradients": int(n_grad), "experts_as_full": int(n_full),
                          "expert_mb_per_point_without": round(without, 3),
                          "expert_mb_per_point_with": round(with_, 3),
                          "reduction": round(without / with_, 2) if with_ else None,
                          "owner_capture_s": float(capture),
                          "recomputed_for_sources": int(recomputed), "peer_recompute_s": float(seconds),
                          "failed": int(failed)}
    for m in OWNER.finditer(stdout):
        rank, remote, lost, wrote, hashed, cpu, entries_cpu = m.groups()
        points = out[int(rank)]["points"]
        out[int(rank)].update(owner_left_to_peers=int(remote or 0), owner_lost=int(lost or 0),
                              owner_written_mb_per_point=round(float(wrote) / max(points, 1), 3),
                              owner_hashed_mb_per_point=round(float(hashed) / max(points, 1), 3),
                              owner_engine_cpu_ms_per_point=round(1e3 * float(cpu) / max(points, 1), 2),
                              owner_entries_cpu_ms_per_point=round(1e3 * float(entries_cpu) / max(points, 1), 2))
    return out


def run(a, local: str, tmp: str) -> dict:
    """One ``torchrun`` with ``--ft-optimizer-recompute-local local``; the parsed per-rank lines."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           os.path.join(ROOT, "pretrain_gpt_moe.py"), *MODELS[a.model][0], "--pipeline-model-parallel-size", "2",
           "--train-iters", str(a.iters), "--log-interval", str(a.iters), "--data-path",
           os.path.join(tmp, "corpus"), "--ft", "--ft-policy", "selective", "--ft-selective-local-budget",
           str(BUDGETS[(a.model, a.experts)]), "--ft-store-dir", os.path.join(tmp, f"store-{local}"),
           "--ft-ranks-per-node", "2", "--ft-replicas", "1", "--ft-optimizer-recompute",
           "--ft-optimizer-recompute-local", local]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
        raise SystemExit(proc.returncode)
    return {f"rank{r}": v for r, v in sorted(parse(proc.stdout).items())}


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", choices=sorted(MODELS))
    p.add_argument("--experts", default="all", choices=["all", "part"])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--local", default="both", choices=["full", "compute", "both"],
                   help="--ft-optimizer-recompute-local of the run(s); both: one run each, side by side")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if (a.model, a.experts) not in BUDGETS:
        p.error(f"--experts {a.experts} is not defined for --model {a.model}; use one of "
                f"{sorted(e for m, e in BUDGETS if m == a.model)}")
    locals_ = ["full", "compute"] if a.local == "both" else [a.local]
    with tempfile.TemporaryDirectory(prefix="optim_recompute_") as tmp:
        from tools.preprocess_data import generated_dataset  # start-up time: the data is made once, here

        generated_dataset(tmp, num_docs=300)  # <tmp>/corpus, which run() trains on
        runs = {local: run(a, local, tmp) for local in locals_}
    report = {"_setup": {"model": a.model, "experts": a.experts, "iters": a.iters,
                         "budget": BUDGETS[(a.model, a.experts)]}, **runs}
    if a.json:
        print(json.dumps(report, indent=1))
        return 0
    for local in locals_:
        print(f"--ft-optimizer-recompute-local {local}")
        print(f"{'rank':>6} {'points':>6} {'grad':>5} {'full':>5} {'MB/pt without':>14} {'MB/pt with':>11} {'ratio':>6} "
              f"{'capture s':>9} {'peer s':>7} {'own MB/pt':>9} {'hashed':>7} {'eng ms/pt':>9}")
        for key, r in report[local].items():
            print(f"{key[4:]:>6} {r['points']:>6} {r['experts_as_gradients']:>5} {r['experts_as_full']:>5} "
                  f"{r['expert_mb_per_point_without']:>14.3f} {r['expert_mb_per_point_with']:>11.3f} "
                  f"{r['reduction']:>6} {r['owner_capture_s']:>9.3f} {r['peer_recompute_s']:>7.3f} "
                  f"{r['owner_written_mb_per_point']:>9.3f} {r['owner_hashed_mb_per_point']:>7.3f} "
                  f"{r['owner_engine_cpu_ms_per_point']:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
