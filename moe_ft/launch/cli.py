"""``moe-ft launch`` (also ``python -m moe_ft.launch``): torchrun's flags, plus warm spares.

    moe-ft launch --standalone --nproc-per-node 4 --spares-per-node 1 --max-restarts 3 \\
        pretrain_gpt_moe.py --ft ...

torchrun's own parser reads the launcher flags (``--standalone``, ``--nnodes``, ``--nproc-per-node``,
``--rdzv-backend/--rdzv-endpoint/--rdzv-id``, ``--max-restarts``, ``--node-rank``, ``--log-dir``,
``--redirects``, ``--tee`` ...) and torch elastic's launcher configuration is derived from them as torchrun
derives it; only the agent differs (:class:`moe_ft.launch.agent.SpareAgent`). Added flags:

``--spares-per-node N``   warm spares per node (default 0: a failed rank is given to a fresh process)
``--reform-timeout S``    seconds a survivor waits for the next attempt before the job falls back to a
                          full restart (default 60)
``--node-timeout S``      several nodes: seconds without a node agent's heartbeat before its ranks go to
                          spares on other nodes (default 10)
``--stop-timeout S``      seconds a worker or spare may stay stopped (SIGSTOP, SIGTSTP) before its agent
                          kills it and replaces it like a failed one (default 30)
``--full-restart``        torchrun's behaviour: any failure restarts every worker
``--preload``             start workers as forks of one server process that imported the training stack
                          (saves each worker its imports; CPU jobs, tests); refused with one line when the
                          imports left the launcher unable to fork workers that use CUDA

When the training flags have the node agent write the durable tier (``--ft-persist-agent``) or hash the
snapshots (``--ft-checksum-by agent``), the launcher starts it before the workers, one per node (``moe_ft/agent/``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import uuid

from torch.distributed import run as torchrun
from torch.distributed.elastic import rendezvous
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from moe_ft.agent.client import ensure_agent
from moe_ft.drills.prelaunch import PreloadError, run_script, use_preloaded_forkserver
from moe_ft.launch import protocol
from moe_ft.launch.agent import Fenced, LaunchLogs, SpareAgent
from moe_ft.persist.config import DurableConfig
from moe_ft.replication.config import ReplicationConfig
from moe_ft.snapshot.config import SnapshotConfig


def build_parser():
    parser = torchrun.get_args_parser()
    parser.prog = "moe-ft launch"
    parser.description = "torchrun that replaces only the failed workers, from warm spares (moe-ft)."
    group = parser.add_argument_group("moe-ft launch")
    group.add_argument("--spares-per-node", type=int, default=0,
                       help="warm spare workers per node: imports done, waiting to take a failed rank")
    group.add_argument("--reform-timeout", type=float, default=protocol.DEFAULT_REFORM_TIMEOUT_S,
                       help="seconds a surviving worker waits for the next attempt before the job falls back "
                            "to a full restart of every worker")
    group.add_argument("--node-timeout", type=float, default=protocol.DEFAULT_NODE_TIMEOUT_S,
                       help="several nodes: seconds without a node agent's heartbeat before the other agents "
                            "give its ranks to their spares")
    group.add_argument("--stop-timeout", type=float, default=protocol.DEFAULT_STOP_TIMEOUT_S,
                       help="seconds a worker or spare may stay stopped (SIGSTOP, SIGTSTP) before its agent kills "
                            "it and replaces it like a failed one")
    group.add_argument("--full-restart", action="store_true",
                       help="torchrun's behaviour: any failure restarts every worker (no in-process recovery)")
    group.add_argument("--preload", action="store_true",
                       help="fork workers from one server process that imported the training stack once (CPU jobs, tests)")
    return parser


def parse_args(argv: list[str] | None = None):
    """torchrun's flags and ours; a bad value exits 2 with argparse's one-line error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.spares_per_node < 0:
        parser.error(f"--spares-per-node must be >= 0 (got {args.spares_per_node})")
    for flag, value in (("--reform-timeout", args.reform_timeout), ("--node-timeout", args.node_timeout),
                        ("--stop-timeout", args.stop_timeout)):
        if not (math.isfinite(value) and value > 0):  # nan compares false; inf overflows a timedelta later
            parser.error(f"{flag} must be a finite number of seconds > 0 (got {value})")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0 (got {args.max_restarts})")
    if args.full_restart and args.spares_per_node:
        parser.error("--spares-per-node needs in-process recovery: drop --full-restart (a full restart starts "
                     "every worker again and uses no spare)")
    if args.spares_per_node and args.max_restarts == 0:  # a fault-free run may launch so: a note, not an error
        print(f"moe-ft launch: --spares-per-node {args.spares_per_node} with --max-restarts 0: a failure stops the "
              "job (each replacement counts as a restart), no spare will take a rank", file=sys.stderr, flush=True)
    if args.standalone:  # what torchrun --standalone means: a private c10d rendezvous on this host
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.preload and (args.no_python or args.module):
        parser.error("--preload runs a Python script file; drop --no-python / -m")
    return args


def node_agent_of(script_args: list[str]) -> tuple[str, float] | None:
    """``(agent directory, idle exit seconds)`` when the training flags have the node agent write the durable
    tier (``--ft --ft-persist-interval N --ft-persist-agent``), hash the snapshots (``--ft --ft-checksum-by
    agent``), publish them (``--ft --ft-publish-by agent``) or move the replicas (``--ft --ft-replicate-by agent``), else ``None``; the directory is the one the trainers use (``<--ft-store-dir>/<--ft-job-id>/agent``),
    the defaults those of the training flags."""
    snap, durable = SnapshotConfig(), DurableConfig()
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--ft", action="store_true")
    p.add_argument("--ft-store-dir", default=snap.store_dir)
    p.add_argument("--ft-job-id", default=snap.job_id)
    p.add_argument("--ft-persist-interval", type=int, default=durable.interval)
    p.add_argument("--ft-persist-agent", action="store_true")
    p.add_argument("--ft-persist-agent-idle-exit", type=float, default=durable.agent_idle_exit)
    p.add_argument("--ft-checksum-by", default=snap.checksum_by)
    p.add_argument("--ft-publish-by", default=snap.publish_by)
    p.add_argument("--ft-replicate-by", default=ReplicationConfig().replicate_by)
    p.add_argument("--ft-replicas", type=int, default=ReplicationConfig().replicas)
    flags, _ = p.parse_known_args(script_args)
    persists = flags.ft_persist_agent and flags.ft_persist_interval > 0
    replicates = flags.ft_replicate_by == "agent" and flags.ft_replicas > 0
    if not (flags.ft and (persists or replicates or "agent" in (flags.ft_checksum_by, flags.ft_publish_by))):
        return None
    return os.path.join(flags.ft_store_dir, flags.ft_job_id, "agent"), flags.ft_persist_agent_idle_exit


def start_node_agent(script_args: list[str]) -> int | None:
    """Start this node's agent before the workers (they find it by its pid file); its pid, or ``None`` when
    the job has none. A job on several nodes gets one per node: every launcher starts its own."""
    where = node_agent_of(script_args)
    if where is None:
        return None
    pid = ensure_agent(where[0], idle_exit_s=where[1], started_by="moe-ft launch")
    print(f"moe-ft launch: node agent {pid} ({where[0]})", file=sys.stderr, flush=True)
    return pid


def _logs(args) -> LaunchLogs:
    return LaunchLogs(root=args.log_dir or None, redirects=Std.from_str(args.redirects), tee=Std.from_str(args.tee),
                      line_prefix_template=getattr(args, "log_line_prefix_template", None))


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config, cmd, cmd_args = torchrun.config_from_args(args)
    entrypoint, entry_args, start_method = cmd, list(cmd_args), config.start_method
    if args.preload:
        entrypoint, entry_args = run_script, [args.training_script, *args.training_script_args]
        try:
            start_method = use_preloaded_forkserver()
        except PreloadError as e:  # before any worker: one line, the launcher's usage exit code
            print(f"error: {e}", file=sys.stderr, flush=True)
            return protocol.USAGE_EXIT_CODE
    params = rendezvous.RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr, **config.rdzv_configs)
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(entry_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params), max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval, master_addr=None, master_port=None, local_addr=config.local_addr)
    inprocess = not args.full_restart and (config.max_nodes == 1 or config.rdzv_backend == "c10d")
    if not inprocess and not args.full_restart:
        print(f"moe-ft launch: --rdzv-backend {config.rdzv_backend} across nodes: failures restart every worker "
              "(in-process replacement across nodes goes through the c10d rendezvous store)",
              file=sys.stderr, flush=True)
    agent = SpareAgent(spec, _logs(args), spares_per_node=args.spares_per_node if inprocess else 0,
                       reform_timeout_s=args.reform_timeout, node_timeout_s=args.node_timeout,
                       stop_timeout_s=args.stop_timeout,
                       min_nodes=config.min_nodes if config.min_nodes < config.max_nodes else None,
                       max_nodes=config.max_nodes,
                       start_method=start_method,
                       shutdown_timeout=int(getattr(config, "shutdown_timeout", None) or 30), inprocess=inprocess)
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE",
                          getattr(config, "signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT"))
    start_node_agent(list(args.training_script_args))
    shutdown_rdzv = True
    try:
        result = agent.run()
        if result.is_failed() and not result.failures:  # ranks of a lost node, found by the heartbeat watch:
            # no worker of this node failed, and torch's error report needs one (it asserts)
            print("moe-ft launch: the job stopped: node(s) were lost and could not be recovered (the lines above "
                  "say why: --max-restarts spent, no spare left)", file=sys.stderr, flush=True)
            return 1
        if result.is_failed():
            raise ChildFailedError(name=str(args.training_script), failures=result.failures)
        return 0
    except Fenced as e:  # declared lost by the others: leave without closing their rendezvous
        shutdown_rdzv = False
        print(e, file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        if type(e).__name__ == "SignalException":  # leave the rendezvous open for other agents
            shutdown_rdzv = False
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
