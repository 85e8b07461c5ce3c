"""``moe-ft drill``: run the tiny CPU job fault-free and with injected faults under ``--launcher`` (default
``inprocess``: ``moe-ft launch`` with one warm spare; ``torchrun``: every worker restarts, ``--max-restarts``),
then compare the final training-state digests bitwise.

    moe-ft drill --layout ep2pp2 --policy sparse --iters 12 --fail 1:6 --fail 2:9:snapshot --json

Node-loss drill: the faulty run on ``--nodes N`` simulated nodes (N agents of the launcher,
``moe_ft/drills/cluster.py``), each with its own node-local store, replicas on the other nodes (``--ft-replicas``,
``--ft-ranks-per-node``); ``--fail-node NODE:ITER[:PHASE]`` loses a whole node there (agent + workers SIGKILLed,
its store deleted; its ranks go to spares on the other nodes, or a replacement agent starts); the same ``ITER:PHASE`` on several nodes loses them together::
    moe-ft drill --nodes 2 --layout dp2ep2 --iters 12 --window 4 --fail-node 1:6 --json
    moe-ft drill --nodes 2 --iters 12 --window 4 --fail-node 0:9 --fail-node 1:9 --json   # durable tier

The fault-free reference is one ``--standalone`` launch of the same 4-rank job (same ranks, same
layout, same flags: the digest does not depend on the launcher). A ``persist`` fault (during the ``--save``
write of the durable tier, every ``--persist-interval`` iterations, default the window) works with or
without ``--nodes``::
    moe-ft drill --iters 12 --window 4 --fail 1:7:persist --json

Every input is checked before anything is launched (``moe_ft/drills/checks.py``): a fault that could
never fire, a persist fault off the save interval, a bad ``--extra`` job flag or a missing ``--data`` end the
drill with one line and exit code 2.

Prints one JSON object: ``faultfree_digest``, ``recovered_digest``, ``equal``, ``token_loss`` (sum over
recoveries), ``reports`` (the recovery reports, ``moe_ft/recovery/report.py``), the faults and the
exit codes; with ``--nodes``, also ``node_losses`` (one event per loss: nodes, iteration, phase, survivors),
``nodes_lost`` and ``nodes_replaced``. Exact policies (``sparse``, ``dense``) must give ``equal: true``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from moe_ft.cli.errors import UsageError, reporting, user_input
from moe_ft.drills.checks import check_counts, check_faults, check_job_flags
from moe_ft.drills.cluster import (
    ClusterConfig,
    NodeJoin,
    SimulatedCluster,
    redone_iterations,
)
from moe_ft.drills.faults import KINDS, PHASES, Fault
from moe_ft.drills.launchers import LAUNCHERS, default_launcher, launcher_argv
from moe_ft.drills.processes import dump_stacks_then_kill
from moe_ft.drills.report import read_digest, read_reports
from tools.make_corpus import write_corpus

ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 4  # ranks of the drill's job (torchrun --nproc-per-node, or split over --nodes)
LAYOUTS = {
    "ep2pp2": ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--moe-token-dispatcher-type", "alltoall"],
    "dp2ep2": ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
               "--moe-token-dispatcher-type", "allgather"],
    # four pipeline stages of one layer each, 1F1B (localized recovery: one stage replays)
    "pp4": ["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "1", "--num-layers", "4",
            "--moe-token-dispatcher-type", "alltoall"],
    # two pipeline ranks x two virtual stages of one layer each (interleaved 1F1B), EP=2 inside each stage
    "pp2vp2": ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--num-layers", "4",
               "--num-layers-per-virtual-pipeline-stage", "1", "--moe-token-dispatcher-type", "alltoall"],
    # tensor parallel 2 with sequence parallelism, EP=2 over the two TP groups (experts tensor-parallel too)
    "tp2ep2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
               "--moe-token-dispatcher-type", "alltoall"],
    # tensor parallel 2 with sequence parallelism inside each of two pipeline stages
    "tp2pp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
               "--expert-model-parallel-size", "1", "--moe-token-dispatcher-type", "alltoall"],
    # Lazarus's flexible dispatcher and plain optimizer (the elastic drill re-plans replicas)
    "dp2ep2-flexible": ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "flexible"],
    # two pipeline stages, ranks numbered pipeline before data parallel: one node holds a whole pipeline
    # (the elastic drill loses a data-parallel replica, not a stage)
    "pp2-flexible": ["--pipeline-model-parallel-size", "2", "--use-tp-pp-dp-mapping", "--expert-model-parallel-size",
                     "1", "--moe-token-dispatcher-type", "flexible"],
}
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
        "--seq-length", "32", "--max-position-embeddings", "32", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-aux-loss-coeff", "0.01", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "3e-3",
        "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "3", "--weight-decay", "0.01",
        "--clip-grad", "1.0", "--seed", "1234", "--split", "98,2,0", "--tokenizer-type", "ByteLevel",
        "--log-interval", "100", "--eval-interval", "0"]


def job_argv(*, layout: str, policy: str, iters: int, data: str, store: str, job: str, window: int,
             digest_out: str, faults: list[str], extra: list[str], scope: str = "global") -> list[str]:
    """The job's flags. ``scope``: ``--ft-recovery-scope`` (``global`` here, so that callers written for the
    global replay keep it; ``moe-ft drill --recovery-scope`` defaults to the job's default, ``localized``)."""
    argv = [*TINY, *LAYOUTS[layout], "--train-iters", str(iters), "--data-path", data,
            "--ft", "--ft-policy", policy, "--ft-store-dir", store, "--ft-job-id", job,
            "--ft-sparse-window", str(window), "--ft-digest-out", digest_out, "--ft-recovery-scope", scope, *extra]
    if faults:
        argv += ["--ft-fail", *faults]
    return argv


def torchrun(argv: list[str], *, max_restarts: int, timeout: float, log_path: str, launcher: str = "torchrun",
             launcher_flags: tuple[str, ...] = (), script: str | None = None) -> int:
    """One job under ``launcher`` (``moe_ft.drills.launchers``: torchrun, ``preloaded``, ``inprocess`` ...)
    on this host; ``launcher_flags``: more flags for the launcher (e.g. ``--spares-per-node=0``); ``script``:
    the training script (default ``pretrain_gpt_moe.py``; a test's wrapper of it)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, *launcher_argv(launcher), *launcher_flags, "--standalone", f"--nproc-per-node={WORLD_SIZE}",
           f"--max-restarts={max_restarts}", "--monitor-interval=0.1", script or str(ROOT / "pretrain_gpt_moe.py"), *argv]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            dump_stacks_then_kill(proc.pid)  # the workers' stacks go to the log: where it hung
            proc.wait()
            return 124


def ensure_corpus(workdir: str) -> str:
    sys.path.insert(0, str(ROOT))

    # start-up time: the indexed-dataset writer imports torch; `moe-ft drill --help` stays free of it
    from tools.preprocess_data import preprocess

    write_corpus(os.path.join(workdir, "c.jsonl"), num_docs=300, seed=0)
    preprocess(os.path.join(workdir, "c.jsonl"), os.path.join(workdir, "corpus"), append_eod=True)
    return os.path.join(workdir, "corpus")


def run_job(*, job: str, workdir: str, faults: list[str] | None = None, max_restarts: int = 0,
            timeout: float = 300, launcher: str | None = None, launcher_flags: tuple[str, ...] = (),
            script: str | None = None, **common) -> dict:
    """One launch of the tiny job (``common``: the keywords of :func:`job_argv` but ``job``, ``digest_out``
    and ``faults``; ``launcher``: ``None`` is :func:`moe_ft.drills.launchers.default_launcher`); returns ``rc``,
    ``digest``, ``reports`` and the ``log`` path."""
    digest_out, log = os.path.join(workdir, f"{job}.json"), os.path.join(workdir, f"{job}.log")
    rc = torchrun(job_argv(job=job, digest_out=digest_out, faults=list(faults or []), **common),
                  max_restarts=max_restarts, timeout=timeout, log_path=log, launcher=launcher or default_launcher(),
                  launcher_flags=launcher_flags, script=script)
    return {"rc": rc, "digest": read_digest(digest_out), "reports": read_reports(common["store"], job), "log": log}


def run_node_job(*, job: str, workdir: str, faults: list[str], losses: list, num_nodes: int,
                 max_restarts: int, timeout: float, elastic: bool = False, joins: tuple = (),
                 launcher: str | None = None, launcher_flags: tuple[str, ...] = (), **common) -> dict:
    """The job on ``num_nodes`` simulated nodes (``common``: as :func:`run_job`; ``common['store']`` is the
    root of the node stores ``<store>/node<k>``); returns what :func:`run_job` does plus ``node_losses``,
    ``launches`` (agents started per node) and ``logs`` (one per agent launch)."""

    world = WORLD_SIZE
    if world % num_nodes:
        raise ValueError(f"--nodes {num_nodes} must divide the job's {world} ranks")
    digest_out = os.path.join(workdir, f"{job}.json")
    store_of = lambda node: os.path.join(common["store"], f"node{node}")
    report_dir = lambda node, launch_idx: os.path.join(workdir, f"{job}_reports", f"node{node}.{launch_idx}")

    markers = os.path.join(workdir, f"{job}_faults")  # shared: a rank may move to another node's spare

    def argv_for(node: int, launch_idx: int, pending: list[str]) -> list[str]:
        argv = job_argv(job=job, digest_out=digest_out, faults=pending, **dict(common, store=store_of(node)))
        return argv + ["--ft-report-dir", report_dir(node, launch_idx), "--ft-fail-marker-dir", markers]

    cluster = SimulatedCluster(ClusterConfig(num_nodes=num_nodes, ranks_per_node=world // num_nodes,
                                             max_restarts=max_restarts, timeout=timeout, elastic=elastic,
                                             joins=tuple(joins), launcher=launcher or default_launcher(),
                                             launcher_flags=tuple(launcher_flags)),
                               script=str(ROOT / "pretrain_gpt_moe.py"), root=str(ROOT), store_of=store_of,
                               argv_for=argv_for, log_prefix=os.path.join(workdir, job), run_id=job,
                               marker_dir=markers)
    res = cluster.run([Fault.parse(f) for f in faults], list(losses))
    dirs = [report_dir(int(n), i) for n, k in res["launches"].items() for i in range(k)]
    reports = read_reports(dirs)
    redone_iterations(res["node_losses"], reports)
    return dict(res, digest=read_digest(digest_out), reports=reports, report_dirs=dirs,
                log=res["logs"][0] if res["logs"] else None)


def durable_flags(*, persist_faults: list[str], all_lost: bool, work: str, window: int,
                  persist_interval: int = -1, persist_dir: str = "") -> list[str]:
    """The durable tier of a drill (``persist_interval`` -1: the window when a loss takes every node or a
    ``persist`` fault is given, else off). ``persist`` faults (``RANK:ITER:persist...``, ``NODE:ITER:persist``)
    also need ``--save`` at the same interval: the runtime checks them right before that save, while the
    durable writer flushes the same iteration."""
    interval = persist_interval if persist_interval >= 0 else (window if all_lost or persist_faults else 0)
    if all_lost and not interval:
        raise ValueError("losing every node needs the durable tier: --persist-interval K > 0")
    flags = []
    if interval:
        flags += ["--ft-persist-interval", str(interval), "--ft-persist-dir",
                  persist_dir or os.path.join(work, "durable")]
    if persist_faults:
        if not interval:
            raise ValueError(f"persist faults {persist_faults} fire during a --save write of the durable tier: "
                             "drop --persist-interval 0 (or give K > 0)")
        bad = [f for f in persist_faults if (int(f.split(":")[1]) + 1) % interval]
        if bad:
            t = int(bad[0].split(":")[1])
            raise ValueError(f"persist faults {bad} must sit at an iteration t with (t + 1) a multiple of "
                             f"--persist-interval ({interval}), e.g. t = {t + (-(t + 1)) % interval}: the runtime "
                             "checks them at that save")
        flags += ["--save", os.path.join(work, "save"), "--save-interval", str(interval)]
    return flags


def node_flags(*, nodes: int, losses: list, faults: list[str], work: str, window: int, replicas: int = 0,
               persist_interval: int = -1, persist_dir: str = "") -> list[str]:
    """The FT flags of a ``--nodes`` drill: replicas on other nodes (``replicas`` 0: ``min(2, nodes - 1)``),
    the node layout, and the durable tier (:func:`durable_flags`; every node lost at once needs it)."""
    everyone = set(range(nodes))
    all_lost = any({l.node for l in losses if (l.iteration, l.phase) == (m.iteration, m.phase)} == everyone
                   for m in losses)
    persist_faults = [f for f in faults if f.split(":")[2] == "persist"] + [str(l) for l in losses
                                                                           if l.phase == "persist"]
    flags = ["--ft-replicas", str(replicas or min(2, nodes - 1)), "--ft-ranks-per-node", str(WORLD_SIZE // nodes)]
    return flags + durable_flags(persist_faults=persist_faults, all_lost=all_lost, work=work, window=window,
                                 persist_interval=persist_interval, persist_dir=persist_dir)


def drill_flags(args, faults: list[str], losses: list, work: str) -> list[str]:
    """The FT flags the drill adds to the job (before ``--extra``, which may override them)."""
    if args.nodes > 1:
        flags = node_flags(nodes=args.nodes, losses=losses, faults=faults, work=work, window=args.window,
                           replicas=args.replicas, persist_interval=args.persist_interval, persist_dir=args.persist_dir)
    else:
        flags = durable_flags(persist_faults=[f for f in faults if f.split(":")[2] == "persist"], all_lost=False,
                              work=work, window=args.window, persist_interval=args.persist_interval,
                              persist_dir=args.persist_dir)
    if getattr(args, "elastic", False):  # lost nodes are not replaced: the job re-plans

        if args.nodes < 2:
            raise ValueError("--elastic loses nodes without replacing them: add --nodes N (N >= 2)")
        for join in getattr(args, "join_node", []):
            if not 0 <= NodeJoin.parse(join).node < args.nodes:
                raise ValueError(f"--join-node {join}: node does not exist (--nodes {args.nodes})")
        flags += ["--ft-elastic", "--log-interval", "1"]  # every loss: the curves are compared
    elif getattr(args, "join_node", None):
        raise ValueError("--join-node starts a lost node again: it needs --elastic")
    if any(f.split(":")[3] == "hang" for f in faults) and "--ft-hang-timeout" not in args.extra:
        flags += ["--ft-hang-timeout", "20"]
    return flags


def prepare(args) -> tuple[str, dict, list[str], list]:
    """Check every input before anything runs (a ``UsageError`` on the first problem; a temporary
    workdir made for the drill is removed again). Returns ``(workdir, common job keywords, faults,
    node losses)``."""

    with user_input():
        check_counts(args, world_size=WORLD_SIZE)
        faults, losses = check_faults(args.fail, args.fail_node, nodes=args.nodes, iters=args.iters,
                                      world_size=WORLD_SIZE)
    work = args.workdir or tempfile.mkdtemp(prefix="moe_ft_drill_")
    try:
        with user_input():
            try:
                os.makedirs(work, exist_ok=True)
            except OSError as e:
                raise ValueError(f"--workdir {work}: cannot create it ({e.strerror})") from None
            extra = drill_flags(args, faults, losses, work) + list(args.extra or [])
        store = args.store_dir or os.path.join("/dev/shm", f"moe_ft_drill_{os.getpid()}")
        common = dict(layout=args.layout, policy=args.policy, iters=args.iters, data=args.data or ensure_corpus(work),
                      store=store, window=args.window, extra=extra, scope=args.recovery_scope)
        with user_input():  # ValueError; OSError: a file a flag names (e.g. --ft-expert-loads-from)
            check_job_flags(job_argv(job="faulty", digest_out=os.path.join(work, "faulty.json"), faults=faults,
                                     **common), world_size=WORLD_SIZE, root=str(ROOT))
    except UsageError:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        raise
    return work, common, faults, losses


def drill(args) -> dict:
    work, common, faults, losses = prepare(args)
    store = common["store"]
    out = {"layout": args.layout, "policy": args.policy, "iters": args.iters, "faults": faults, "workdir": work}
    try:
        common["launcher"] = getattr(args, "launcher", None)
        ref = run_job(job="faultfree", workdir=work, timeout=args.timeout, **common)
        if args.nodes > 1:
            joins = tuple(NodeJoin.parse(j) for j in getattr(args, "join_node", []))
            bad = run_node_job(job="faulty", workdir=work, faults=faults, losses=losses, num_nodes=args.nodes,
                               max_restarts=args.max_restarts, timeout=args.timeout,
                               elastic=getattr(args, "elastic", False),
                               joins=joins, launcher_flags=tuple(getattr(args, "launcher_flags", ())), **common)
            out["nodes"] = args.nodes
            out["fail_node"] = [str(l) for l in losses]
            out["node_losses"] = bad["node_losses"]
            out["nodes_lost"] = sum(len(e["nodes"]) for e in bad["node_losses"])
            out["nodes_replaced"] = sum(bad["launches"].values()) - args.nodes
            out["faulty_logs"] = bad["logs"]
        else:
            bad = run_job(job="faulty", workdir=work, faults=faults, max_restarts=args.max_restarts,
                          timeout=args.timeout, **common)
        out["faultfree_rc"], out["faulty_rc"] = ref["rc"], bad["rc"]
        out["faultfree_digest"], out["recovered_digest"] = ref["digest"], bad["digest"]
        out["equal"] = ref["digest"] is not None and ref["digest"] == bad["digest"]
        out["reports"] = bad["reports"]
        out["token_loss"] = sum(r["token_loss"].get("tokens", 0.0) for r in out["reports"])
        if getattr(args, "elastic", False):  # not bitwise after a world change: loss curves and parameter deviation instead

            out["node_joins"] = bad.get("node_joins", [])
            # start-up time: the report reads tensors (torch); `moe-ft drill --help` stays free of it
            from moe_ft.drills.report import summary

            out["elastic"] = summary(reference_log=ref["log"], faulty_logs=bad["logs"],
                                     reference_dump=os.path.join(work, "faultfree.json"),
                                     faulty_dump=os.path.join(work, "faulty.json"),
                                     report_dirs=bad["report_dirs"])
    finally:
        if not args.keep_store:
            shutil.rmtree(store, ignore_errors=True)
    return out


def run(args) -> int:
    result = drill(args)
    if args.json:
        print(json.dumps(result))
    else:
        for e in result.get("node_losses", []):
            print(f"lost node(s) {e['nodes']} at iteration {e['iteration']} ({e['phase']}), survivors "
                  f"{e['survivors']}, replacement after {e['seconds_to_replacement']} s; recovered from "
                  f"{e.get('recovery_source')} point {e.get('recovery_end')}, {e.get('iterations_redone')} "
                  f"iterations trained again")
        for r in result["reports"]:
            kept = {True: ", survivors kept their processes", False: ", some survivors restarted"}.get(
                r.get("survivor_pids_kept"), "")
            print(f"restart {r['restart_count']} ({r.get('restart_kind', 'job')}{kept}): point {r['recovery_point']} "
                  f"replayed {r['replayed_iterations']} "
                  f"re-executed {r['reexecuted_iterations']} seconds {r['seconds']} token loss {r['token_loss'].get('tokens')}")
            sc = r.get("scope") or {}
            if sc:
                print(f"  scope {sc.get('mode')}: {sc.get('reason')}" + (
                    f"; replayed {sc.get('replayed')}, loaded {sc.get('loaded')}, log bytes read "
                    f"{sc.get('log_bytes_read')}" if sc.get("mode") == "localized" else ""))
        print(f"fault-free {result['faultfree_digest']}\nrecovered  {result['recovered_digest']}\n"
              f"{'EQUAL' if result['equal'] else 'NOT EQUAL'}")

    # start-up time: the policies import torch; `moe-ft drill --help` stays free of it
    from moe_ft.policy.factory import policy_class

    policy = policy_class(args.policy)
    assert policy is not None  # the parser accepted only registered policies
    exact = not policy.lossy
    return 0 if (result["equal"] or not exact or getattr(args, "elastic", False)) and result.get("faulty_rc") == 0 else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("drill", help="fault-free vs faulty run of the tiny CPU job, digests compared")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="ep2pp2")
    p.add_argument("--policy", choices=["sparse", "dense", "pec", "selective"], default="sparse")
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--window", type=int, default=4, help="--ft-sparse-window of the job")
    p.add_argument("--recovery-scope", choices=["global", "localized"], default="localized",
                   help="--ft-recovery-scope of the job: localized = only the failed pipeline stages replay "
                        "(survivors load the state they published), global = every rank replays")
    p.add_argument("--fail", action="append", default=[], metavar="RANK:ITER[:PHASE[:KIND]]",
                   help=f"a fault (repeatable); PHASE {'|'.join(PHASES)} (default forward), KIND {'|'.join(KINDS)} "
                        "(default exit); e.g. RANK:ITER:published:corrupt damages the just-published point, then dies")
    p.add_argument("--nodes", type=int, default=1,
                   help="simulated nodes of the faulty run (one agent of --launcher each; 1 = one --standalone launch)")
    p.add_argument("--fail-node", action="append", default=[], metavar="NODE:ITER[:PHASE]",
                   help="lose a whole node there (repeatable; the same ITER:PHASE on several nodes loses them "
                        "together); its store is deleted, and its ranks go to spares on the other nodes or a replacement "
                        "node starts")
    p.add_argument("--replicas", type=int, default=0, help="--ft-replicas with --nodes (0: min(2, nodes - 1))")
    p.add_argument("--elastic", action="store_true",
                   help="with --nodes: a lost node is not replaced (torchrun --nnodes 1:N); the job re-plans its "
                        "expert replicas and goes on with the survivors (--ft-elastic; needs a flexible layout)")
    p.add_argument("--join-node", action="append", default=[], metavar="NODE:ITER",
                   help="--elastic: start NODE again once the job completed ITER (the world grows)")
    p.add_argument("--persist-interval", type=int, default=-1,
                   help="--ft-persist-interval of the job (-1: the window when every node is lost or a "
                        "persist fault is given, else 0)")
    p.add_argument("--persist-dir", default="", help="durable tier root (default: <workdir>/durable)")
    p.add_argument("--max-restarts", type=int, default=3)
    p.add_argument("--launcher", choices=sorted(LAUNCHERS), default=None,
                   help="what starts the agents: 'inprocess' (default, or $MOE_FT_DRILL_LAUNCHER): moe-ft launch "
                        "with one warm spare, the survivors keep their processes (docs/launch.md); 'torchrun': "
                        "every worker restarts; 'preloaded': "
                        "torchrun's agent with workers forked from a process that imported the training stack "
                        "once (moe_ft/drills/prelaunch.py); 'inprocess-preloaded': both")
    p.add_argument("--data", default="", help="dataset prefix (default: a generated tiny corpus)")
    p.add_argument("--workdir", default="", help="logs and digests (default: a temp dir)")
    p.add_argument("--store-dir", default="", help="node-local store root (default: /dev/shm/moe_ft_drill_<pid>)")
    p.add_argument("--keep-store", action="store_true")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", action="store_true")
    p.add_argument("--extra", nargs=argparse_remainder(), default=[], help="more job flags, e.g. --extra --ft-pec-k 1")
    p.set_defaults(func=reporting("drill", run))


def argparse_remainder():
    return argparse.REMAINDER
