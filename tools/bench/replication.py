"""What replication costs the training processes: by the trainer's own threads vs by the node agents, side by
side in one run.

    python tools/bench/replication.py [--mb 64] [--points 6] [--repeats 2] [--json]

Two processes stand for two nodes (a store root each, a gloo group of two); each rank publishes a point of
``--mb`` MB per iteration into its node-local store and replicates it to the other, in three modes, in
alternating blocks of ``--points`` points (``--repeats`` times):

* ``none``: publish only (the baseline: writing the store);
* ``trainer``: ``ReplicaSender`` / ``ReplicaReceiver`` threads in the rank's process, over a dedicated gloo
  group (``--ft-replicate-by trainer``);
* ``agent``: the rank names each point to its node agent, which sends it over TCP to the other node's agent,
  which verifies and publishes it (``--ft-replicate-by agent``).

Each block ends once every point reached the peer. Reported per mode (medians over the blocks, summed over
the two ranks): ``trainer_cpu_ms_per_point`` (the rank processes' CPU, every thread, from ``getrusage``),
``replication_trainer_cpu_ms_per_point`` (that minus ``none``'s: what replicating costs the trainer),
``agent_cpu_ms_per_point`` (the two agents' CPU), ``wall_ms_per_point``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = ("none", "trainer", "agent")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def worker(rank: int, port: int, work: str, mb: int, points: int, repeats: int, out: str) -> None:
    sys.path.insert(0, ROOT)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import torch
    import torch.distributed as dist

    from moe_ft.agent.client import AgentClient
    from moe_ft.agent.replicas import ReplicaSelect
    from moe_ft.agent.replication import AgentReceiver, AgentSender, agent_endpoints
    from moe_ft.replication import (
        GlooTransport,
        GlooTransportConfig,
        ReceiverConfig,
        ReplicaReceiver,
        ReplicaSender,
        SenderConfig,
    )
    from moe_ft.replication.receiver import replica_store_config
    from moe_ft.state.operators import Level, OperatorId
    from moe_ft.store import DenseRule, KeepNewestRecoverable, StoreConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    peer, root = 1 - rank, os.path.join(work, f"node{rank}")
    ops = [OperatorId.expert_op(0, e) for e in range(4)]
    tensor = torch.randn(mb * (1 << 20) // 16)  # 4 operators of mb/4 MB
    store = StoreConfig(root=root, job_id="bench", rank=rank).build(
        retention=KeepNewestRecoverable(rule=DenseRule(operators=frozenset(ops))))
    select = ReplicaSelect(dp_copy_off_node=False, expert_dp_copy_off_node=False, distributed_optimizer=False)
    # the replicas of each mode in a directory of their own: one process writes a store (the receiving
    # trainer, or the node agent)
    store_for = lambda owner: replica_store_config(root=root, job_id="bench", owner=owner).build()  # noqa: E731
    agent_store_for = lambda owner: replica_store_config(root=root, job_id="bench-agent", owner=owner).build()  # noqa: E731
    config = GlooTransportConfig()
    transport = GlooTransport(config, config.build_group())
    client = AgentClient(os.path.join(root, "bench", "agent"), rank, idle_exit_s=60)
    ends = agent_endpoints(client, rank=rank, store_root=root, job_id="bench-agent", per_holder=False)
    trainer_side = (ReplicaSender(SenderConfig(), store, transport, [peer], owner=rank, select=select),
                    ReplicaReceiver(ReceiverConfig(), transport, [peer], store_for))
    agent_side = (AgentSender(client, rank=rank, store=store, peers=[ends[peer]], select=select),
                  AgentReceiver(client, rank=rank, sources=[peer], store_for=agent_store_for))
    results: dict[str, list[dict]] = {m: [] for m in MODES}
    iteration = 0
    for _ in range(repeats):
        for mode in MODES:
            dist.barrier()
            agent0, cpu0, t0 = client.call("replica_flush", rank)["cpu_s"], _cpu_s(), time.perf_counter()
            for _ in range(points):
                with store.begin(iteration) as point:
                    for op in ops:
                        point.put(op, Level.FULL, {"w": tensor})
                    point.put_meta({"iteration": iteration})
                    point.publish()
                sender = {"trainer": trainer_side[0], "agent": agent_side[0]}.get(mode)
                if sender is not None:  # sent before the next publish collects it: every point is replicated
                    sender.submit(iteration)
                    sender.flush()
                iteration += 1
            replicas = {"trainer": trainer_side[1], "agent": agent_side[1]}.get(mode)
            while replicas is not None and (iteration - 1) not in replicas.store(peer).points():  # the copy is in
                time.sleep(0.002)
            dist.barrier()
            wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
            agent_cpu = client.call("replica_flush", rank)["cpu_s"] - agent0
            results[mode].append({"cpu_s": cpu, "wall_s": wall, "agent_cpu_s": agent_cpu})
    trainer_side[0].close()
    trainer_side[1].join(timeout=60)
    agent_side[0].close()
    client.bye()
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=64, help="MB per point")
    p.add_argument("--points", type=int, default=6, help="points per block")
    p.add_argument("--repeats", type=int, default=2, help="blocks per mode (alternating)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    import multiprocessing

    sys.path.insert(0, ROOT)
    from tests._ft_helpers import free_port

    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench_replication_") as work:
        port = free_port()
        outs = [os.path.join(work, f"rank{r}.json") for r in (0, 1)]
        procs = [ctx.Process(target=worker, args=(r, port, work, a.mb, a.points, a.repeats, outs[r])) for r in (0, 1)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode for proc in procs):
            print(json.dumps({"error": f"worker exit codes {[proc.exitcode for proc in procs]}"}))
            return 1
        ranks = [json.load(open(o)) for o in outs]
    # agents: each rank's reading is its own agent's (one per node): summed over the two
    per_block = {m: [{k: sum(r[m][i][k] for r in ranks) for k in ("cpu_s", "wall_s", "agent_cpu_s")}
                     for i in range(a.repeats)] for m in MODES}
    med = {m: {k: statistics.median(b[k] for b in blocks) * 1e3 / a.points for k in ("cpu_s", "wall_s", "agent_cpu_s")}
           for m, blocks in per_block.items()}
    out = {"mb_per_point": a.mb, "points": a.points, "repeats": a.repeats, "modes": {}}
    for m in MODES:
        out["modes"][m] = {"trainer_cpu_ms_per_point": round(med[m]["cpu_s"], 1),
                           "replication_trainer_cpu_ms_per_point": round(med[m]["cpu_s"] - med["none"]["cpu_s"], 1),
                           "agent_cpu_ms_per_point": round(med[m]["agent_cpu_s"], 1) if m == "agent" else None,
                           "wall_ms_per_point": round(med[m]["wall_s"] / 2, 1)}
    if a.json:
        print(json.dumps(out))
    else:
        for m, row in out["modes"].items():
            print(f"{m:8s} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
