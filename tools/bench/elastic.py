"""Samples per hour over a failure sequence: keep training on fewer nodes vs wait for a spare (Lazarus §5,
Figs. 6-9 trend).

    python -m tools.bench.elastic [--nodes 8] [--hours 24] [--mtbf-hours 6] \\
        [--spare-delay-min 30] [--restart-s 30] [--reshape-s 30] [--iter-time-s 1.0] [--seed 0] [--json]

A seeded failure sequence (node failures at exponential intervals of ``--mtbf-hours`` divided by the live
nodes; a failed node is replaced and can rejoin after ``--spare-delay-min``) is played against two policies:

* ``elastic`` (moe-ft ``--ft-elastic``, Lazarus): after a failure the job restarts on the survivors
  (``--reshape-s``: detection, restart, re-plan, restore) and trains at the smaller world's rate; a replaced
  node rejoins with another reshape;
* ``spare`` (the usual fault tolerance): the job stops until a replacement node arrives
  (``--spare-delay-min``), restarts (``--restart-s``) and trains on all ``--nodes``.

The global batch is fixed (same math), so an iteration on ``n`` of ``N`` nodes takes ``iter_time x N / n``
(data-parallel scaling; the measured CPU drill shows the same global batch on half the ranks in
``GBS / (MBS x DP)`` micro-batches). Reported: samples per hour of each policy, per hour and in total, and
the ratio; the failure sequence is printed so the run can be reproduced.
"""

from __future__ import annotations

import argparse
import json
import random


def failure_sequence(nodes: int, hours: float, mtbf_hours: float, spare_delay_h: float, seed: int) -> list[tuple]:
    """``[(time_h, 'fail'|'join', node)]``: each live node fails at rate 1/MTBF; its replacement joins
    ``spare_delay_h`` later."""
    rng = random.Random(seed)
    events, t, up, down = [], 0.0, set(range(nodes)), {}
    while True:
        rate = len(up) / mtbf_hours if up else 0.0
        next_fail = t + (rng.expovariate(rate) if rate else float("inf"))
        next_join = min(down.values(), default=float("inf"))
        t = min(next_fail, next_join)
        if t >= hours:
            return events
        if t == next_join:
            node = min(n for n, when in down.items() if when == t)
            del down[node]
            up.add(node)
            events.append((t, "join", node))
        else:
            node = rng.choice(sorted(up))
            up.discard(node)
            down[node] = t + spare_delay_h
            events.append((t, "fail", node))


def simulate(policy: str, events: list[tuple], *, nodes: int, hours: float, iter_time_s: float, samples_per_iter: int,
             restart_s: float, reshape_s: float) -> list[float]:
    """Samples trained in each hour by ``policy`` (``elastic`` or ``spare``)."""
    per_hour = [0.0] * int(hours + 0.999)
    rate_at = lambda n: samples_per_iter / (iter_time_s * nodes / n) if n else 0.0  # noqa: E731 (samples/s)

    def train(start_h: float, end_h: float, n: int) -> None:
        t = start_h
        while t < end_h:
            hour_end = min(end_h, int(t) + 1)
            per_hour[min(int(t), len(per_hour) - 1)] += rate_at(n) * (hour_end - t) * 3600
            t = hour_end

    t, live = 0.0, nodes
    for when, kind, _ in events + [(hours, "end", -1)]:
        if policy == "elastic":
            train(t, when, live)
            if kind == "end":
                break
            live += -1 if kind == "fail" else 1
            t = min(hours, max(t, when + reshape_s / 3600))  # the job restarts on the new world
        else:
            train(t, when, live) if live == nodes else None
            if kind == "end":
                break
            live += -1 if kind == "fail" else 1
            t = max(t, when)
            if live == nodes:  # the last missing replacement arrived: restart on every node
                t = min(hours, when + restart_s / 3600)
    return per_hour


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--mtbf-hours", type=float, default=6.0, help="mean time between failures of one node")
    p.add_argument("--spare-delay-min", type=float, default=30.0, help="minutes until a spare node arrives")
    p.add_argument("--restart-s", type=float, default=30.0, help="restart after a spare arrived")
    p.add_argument("--reshape-s", type=float, default=30.0, help="restart + re-plan + restore on a new world")
    p.add_argument("--iter-time-s", type=float, default=1.0, help="seconds per iteration on all nodes")
    p.add_argument("--samples-per-iter", type=int, default=1024, help="global batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.nodes < 2 or a.hours <= 0 or a.mtbf_hours <= 0 or a.iter_time_s <= 0:
        p.error("need --nodes >= 2 and positive --hours, --mtbf-hours, --iter-time-s")
    events = failure_sequence(a.nodes, a.hours, a.mtbf_hours, a.spare_delay_min / 60, a.seed)
    kw = dict(nodes=a.nodes, hours=a.hours, iter_time_s=a.iter_time_s, samples_per_iter=a.samples_per_iter,
              restart_s=a.restart_s, reshape_s=a.reshape_s)
    out = {"failures": [[round(t, 3), kind, node] for t, kind, node in events],
           "elastic": simulate("elastic", events, **kw), "spare": simulate("spare", events, **kw)}
    out["total"] = {k: sum(out[k]) for k in ("elastic", "spare")}
    ideal = a.samples_per_iter / a.iter_time_s * 3600 * a.hours
    out["fraction_of_ideal"] = {k: out["total"][k] / ideal for k in ("elastic", "spare")}
    out["elastic_over_spare"] = out["total"]["elastic"] / max(out["total"]["spare"], 1e-9)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{sum(e[1] == 'fail' for e in events)} failures in {a.hours:g} h on {a.nodes} nodes "
          f"(MTBF {a.mtbf_hours:g} h/node, replacement after {a.spare_delay_min:g} min)")
    print("hour  elastic samples/h   spare samples/h")
    for h, (e, s) in enumerate(zip(out["elastic"], out["spare"])):
        print(f"{h:4d}  {e:17.0f}  {s:16.0f}")
    print(f"total: elastic {out['total']['elastic']:.0f} ({100 * out['fraction_of_ideal']['elastic']:.1f} % of "
          f"fault-free), spare {out['total']['spare']:.0f} ({100 * out['fraction_of_ideal']['spare']:.1f} %); "
          f"elastic / spare = {out['elastic_over_spare']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
