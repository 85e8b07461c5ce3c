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
from typing import NoReturn

from torch.distributed import run as torchrun
from torch.distributed.elastic import rendezvous
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from moe_ft.agent.client import ensure_agent
from moe_ft.drills.prelaunch import PreloadError, run_script, use_preloaded_forkserver
from moe_ft.launch import protocol
from moe_ft.launch.agent import SpareAgent
from moe_ft.launch.logs import LaunchLogs
from moe_ft.launch.membership import Fenced
from moe_ft.persist.config import DurableConfig
from moe_ft.replication.config import ReplicationConfig
from moe_ft.snapshot.config import SnapshotConfig

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""The longest ``--reform-timeout``, ``--node-timeout``, ``--stop-timeout`` and ``--monitor-interval`` taken
(a week): a longer one reaches torch as a ``timedelta`` or a store timeout at the first recovery, which
overflows there (``1e14`` s did) long after the launch."""


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
    """torchrun's flags and ours; a bad value exits 2 with one line naming the flag (argparse's ``error``
    would print torchrun's whole usage, 25 lines, above it)."""
    parser = build_parser()
    args = parser.parse_args(argv)

    def refuse(message: str) -> NoReturn:
        print(f"{parser.prog}: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(protocol.USAGE_EXIT_CODE)

    if args.spares_per_node < 0:
        refuse(f"--spares-per-node must be >= 0 (got {args.spares_per_node})")
    for flag, value in (("--reform-timeout", args.reform_timeout), ("--node-timeout", args.node_timeout),
                        ("--stop-timeout", args.stop_timeout), ("--monitor-interval", args.monitor_interval)):
        # nan compares false; inf, or a value past the cap, overflows a timedelta at the first recovery
        if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
            refuse(f"{flag} must be a finite number of seconds > 0, at most {MAX_TIMEOUT_S:.0f} (a week) "
                   f"(got {value})")
    # torchrun's own checks of these raise (AssertionError, ValueError) with a traceback, after the parse
    try:
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    except (ValueError, RuntimeError):
        refuse(f"--nnodes must be N or MIN:MAX, whole numbers (got {args.nnodes!r})")
    if not 0 < min_nodes <= max_nodes:
        refuse(f"--nnodes MIN:MAX needs 0 < MIN <= MAX (got {args.nnodes})")
    try:
        nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as e:
        nproc, why = 0, f": {e}"
    else:
        why = ""
    if nproc <= 0:
        refuse(f"--nproc-per-node must be a number of processes > 0, or cpu, gpu, xpu or auto (got "
               f"{args.nproc_per_node!r}{why})")
    if args.max_restarts < 0:
        refuse(f"--max-restarts must be >= 0 (got {args.max_restarts})")
    if args.full_restart and args.spares_per_node:
        refuse("--spares-per-node needs in-process recovery: drop --full-restart (a full restart starts "
               "every worker again and uses no spare)")
    if args.spares_per_node and args.max_restarts == 0:  # a fault-free run may launch so: a note, not an error
        print(f"moe-ft launch: --spares-per-node {args.spares_per_node} with --max-restarts 0: a failure stops the "
              "job (each replacement counts as a restart), no spare will take a rank", file=sys.stderr, flush=True)
    if args.standalone:  # what torchrun --standalone means: a private c10d rendezvous on this host
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.preload and (args.no_python or args.module):
        refuse("--preload runs a Python script file; drop --no-python / -m")
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


def _refused(message: str) -> int:
    """A launcher flag refused after the parse: one line, argparse's exit code."""
    print(f"moe-ft launch: error: {message}", file=sys.stderr, flush=True)
    return protocol.USAGE_EXIT_CODE


@record
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # torchrun's checks of its flags (parse_args refuses the common mistakes by name first)
        config, cmd, cmd_args = torchrun.config_from_args(args)
    except (ValueError, AssertionError) as e:
        return _refused(f"{e or type(e).__name__}: check the flags against moe-ft launch --help")
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
    try:  # the backend reads its options from --rdzv-conf here, and raises on a value it cannot read
        handler = rdzv_registry.get_rendezvous_handler(params)
    except ValueError as e:
        return _refused(f"{e} Fix --rdzv-conf (KEY=VALUE,...; timeouts in whole seconds), --rdzv-endpoint or "
                        "--rdzv-backend")
    spec = WorkerSpec(
        role=config.role, local_world_size=config.nproc_per_node, entrypoint=entrypoint, args=tuple(entry_args),
        rdzv_handler=handler, max_restarts=config.max_restarts,
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
        if result is None:  # torch elastic's graceful exit: the rendezvous closed before this node was needed
            print("moe-ft launch: the job's rendezvous closed without this node (a node beyond --nnodes MAX kept "
                  "in reserve, and the job ended): nothing to run", file=sys.stderr, flush=True)
            return 0
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
