"""Seconds per iteration of the tiny CPU configs (examples/tiny_cpu.sh), median over several runs.

    python -m tools.bench.iter_time [--runs 3] [--iters 40] [--layouts ep2pp2 dp2ep2] [--json]

Each run trains ``--iters`` iterations with a log line per iteration; the first 5 iterations (warm-up)
are dropped, the median iteration time of each run is taken, and the median over runs is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINE = re.compile(r"^iteration\s+(\d+)/\d+ \| loss ([\d.]+) .* iter time ([\d.]+) ms")


def run_once(layout: str, iters: int, data: str, workdir: str) -> tuple[list[float], list[float]]:
    env = dict(os.environ, LAYOUT=layout, ITERS=str(iters), DATA=data, SAVE=os.path.join(workdir, layout),
               EXTRA="--log-interval 1 --eval-interval 0 --save-interval 0",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "tiny_cpu.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"tiny_cpu.sh ({layout}) failed:\n{proc.stderr[-3000:]}")
    times, losses = [], []
    for line in proc.stdout.splitlines():
        m = LINE.match(line)
        if m:
            losses.append(float(m.group(2)))
            if int(m.group(1)) > 5:
                times.append(float(m.group(3)) / 1000.0)
    return times, losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--layouts", nargs="+", default=["ep2pp2", "dp2ep2"])
    parser.add_argument("--data", default=os.path.join(ROOT, "data", "corpus"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.data + ".bin"):
        print(f"error: {args.data}.bin missing; run `bash examples/prepare_data.sh` first", file=sys.stderr)
        return 2
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in args.layouts:
            medians, first_last = [], None
            for _ in range(args.runs):
                times, losses = run_once(layout, args.iters, args.data, tmp)
                medians.append(statistics.median(times))
                first_last = (losses[0], losses[-1])
            report[layout] = {"s_per_iter_median": statistics.median(medians), "run_medians": medians,
                              "loss_first": first_last[0], "loss_last": first_last[1]}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for layout, r in report.items():
            print(f"{layout}: {r['s_per_iter_median']:.3f} s/iteration (median of {args.runs} runs: "
                  f"{', '.join(f'{m:.3f}' for m in r['run_medians'])}); loss {r['loss_first']:.2f} -> "
                  f"{r['loss_last']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
