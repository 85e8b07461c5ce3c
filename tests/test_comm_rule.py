"""The communication rule (``docs/communication.md``): no host tensor meets an NCCL group.

Fast, one process (gloo): the checker itself — a raw host-tensor collective on an accelerator-marked group
fails, an object collective there fails, ``moe_ft.comm``'s host and device paths pass, gloo groups take host
tensors, library calls are recorded but not judged — and the host-side call sites of recovery, replication,
the catalogue and the capacity boost, called directly under the checker.

Multi-process (4 gloo ranks under torchrun, ``tests/_workers_comm.py`` installs the checker in every worker):
the real job walks training with PP = 2 (``share_from_last_stage``), snapshots, replication to a second
simulated node, the flexible (elastic) dispatcher, a SIGKILL + torchrun restart + recovery; a second job a lossy
(``pec``) recovery with the capacity boost and the durable tier (whose writes are per rank: no collective; the
test checks its complete points instead). Every call our code
made must obey the rule, and the calls that prove each path ran must be in the records.
"""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from moe_ft import comm
from moe_ft.testing.collective_checker import OUR_PATHS, CollectiveChecker, CommRuleViolation, read_logs
from tests._ft_helpers import ROOT, one_rank_gloo

HERE = os.path.abspath(__file__)


@pytest.fixture
def checker():
    """A one-rank gloo world created *under* the checker (so it sees which groups are gloo); this file counts
    as "our code"."""
    chk = CollectiveChecker(our_paths=(*OUR_PATHS, HERE)).install()
    try:
        with one_rank_gloo():
            yield chk
    finally:
        chk.uninstall()


def _only(chk, fn):
    recs = [r for r in chk.records if r.fn == fn]
    assert len(recs) == 1, [(r.fn, r.caller) for r in chk.records]
    return recs[0]


# -------------------------------------------------------------------------------------------- checker
def test_raw_host_tensor_on_accelerator_group_fails(checker):
    dist.all_reduce(torch.ones(1))  # the bug: on a GPU cluster the default group is NCCL
    rec = _only(checker, "all_reduce")
    assert (rec.kind, rec.origin, rec.devices) == ("accelerator", "ours", ["cpu"])
    assert "host tensor meets accelerator group WORLD" in rec.violation
    assert rec.caller.startswith("tests/test_comm_rule.py:") and rec.caller.endswith(
        "test_raw_host_tensor_on_accelerator_group_fails")
    with pytest.raises(CommRuleViolation, match="1 collective"):
        checker.assert_clean()


def test_object_collective_on_accelerator_group_fails_once(checker):
    out = [None]
    dist.all_gather_object(out, {"a": 1})
    rec = _only(checker, "all_gather_object")  # its internal all_gather is not a second call
    assert "object collective all_gather_object on accelerator group WORLD" in rec.violation
    assert len(checker.records) == 1


def test_non_gloo_subgroup_is_accelerator_gloo_group_is_host(checker):
    nccl_like = dist.new_group(ranks=[0])  # default backend: NCCL on a GPU cluster
    host = dist.new_group(ranks=[0], backend="gloo")
    dist.broadcast(torch.zeros(2), src=0, group=host)
    dist.broadcast(torch.zeros(2), src=0, group=nccl_like)
    ok, bad = [r for r in checker.records if r.fn == "broadcast"]
    assert (ok.kind, ok.violation) == ("host", "")
    assert bad.kind == "accelerator" and "host tensor meets accelerator group" in bad.violation


def test_comm_host_and_device_paths_pass(checker):
    group = dist.new_group(ranks=[0])  # an accelerator-marked group, like Megatron's pipeline group
    assert comm.max_over_ranks(7) == 7 and comm.min_over_ranks(-3) == -3
    assert comm.all_reduce_host([1, 2]) == [1, 2] and comm.all_reduce_host(2.5, "max") == 2.5
    assert comm.all_gather_object({"x": 1}) == [{"x": 1}]
    assert comm.broadcast_object("hi", src=0) == "hi"
    comm.barrier()
    t = torch.tensor([3.0], device=comm.device_for(group))
    comm.broadcast(t, src=0, group=group)
    comm.all_reduce(t, group=group)
    out = torch.empty(1)
    comm.all_gather_into_tensor(out, t, group=group)
    comm.all_reduce_world(torch.ones(3))
    checker.assert_clean()
    kinds = {(r.fn, r.kind, r.origin) for r in checker.records}
    assert {("all_reduce", "host", "comm"), ("all_gather_object", "host", "comm"),
            ("broadcast_object_list", "host", "comm"), ("barrier", "host", "comm"),
            ("broadcast", "accelerator", "comm"), ("all_reduce", "accelerator", "comm"),
            ("all_gather_into_tensor", "accelerator", "comm")} <= kinds
    assert all(r.site.startswith("tests/test_comm_rule.py:") for r in checker.records)


def test_host_path_refuses_device_tensors_and_unknown_ops(checker):
    with pytest.raises(ValueError, match="unknown reduce op"):
        comm.all_reduce_host(1, "mean")
    meta = torch.empty(1, device="meta")
    with pytest.raises(ValueError, match="takes host tensors"):
        comm.all_reduce_host(meta)


def test_library_calls_are_recorded_not_judged(checker):
    lib = "/opt/some-site-packages/library_module.py"
    code = compile("def reduce(t):\n    dist.all_reduce(t)\n", lib, "exec")
    scope = {"dist": dist}
    exec(code, scope)
    scope["reduce"](torch.ones(1))
    rec = _only(checker, "all_reduce")
    assert (rec.origin, rec.violation) == ("library", "")
    assert rec.site.endswith("test_library_calls_are_recorded_not_judged")
    checker.assert_clean()


def test_strict_raises_at_the_call():
    original = dist.all_reduce
    with CollectiveChecker(our_paths=(*OUR_PATHS, HERE), strict=True), one_rank_gloo():
        with pytest.raises(CommRuleViolation, match="host tensor meets accelerator group"):
            dist.all_reduce(torch.ones(1))
    assert dist.all_reduce is original and torch.distributed.distributed_c10d.all_reduce is original  # uninstalled


def test_backend_parsing_chooses_the_device():
    assert comm.parse_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert comm.parse_backends("nccl") == {"cuda": "nccl"} and comm.parse_backends("gloo") == {"cpu": "gloo"}
    from megatron.training.collectives import device_of

    assert device_of({"cuda": "nccl"}, cuda_available=True) == "cuda"
    assert device_of({"cpu": "gloo", "cuda": "nccl"}, cuda_available=True) == "cuda"
    assert device_of({"cpu": "gloo", "cuda": "gloo"}, cuda_available=True) == "cpu"
    assert device_of({"cuda": "nccl"}, cuda_available=False) == "cpu"


def test_coordination_group_is_created_once_per_world(checker):
    first = comm.coordination_group()
    assert comm.init_coordination() is first and checker.is_host(first)
    assert first.group_desc == comm.COORDINATION_DESC


# ------------------------------------------------------------------------------------ call sites, direct
def test_host_call_sites_follow_the_rule(checker, tmp_path):
    """Recovery agreement, lossy token loss, the catalogue, the capacity boost, the digest and the replication
    layout, called as the runtime calls them."""
    from moe_ft.megatron_ext.router import CapacityBoost, CapacityBoostConfig
    from moe_ft.recovery.agreement import agree_on_point
    from moe_ft.recovery.lossy import gather_expert_full_at
    from moe_ft.state.catalogue import gather_catalogue

    point = SimpleNamespace(end=4)
    assert agree_on_point(lambda bound: point) == (point, [4])
    assert gather_expert_full_at({}) == {}
    assert gather_catalogue([], ep_size=1) == []
    cb = CapacityBoost(CapacityBoostConfig(capacity_factor=1.0, boost=0.1), moe_layers=[0], num_experts=2,
                       all_reduce=comm.all_reduce_world)
    cb.start(torch.tensor([[3.0, 0.0]]))
    cb.end_iteration(0)
    checker.assert_clean()
    sites = {_where(r.site) for r in checker.records}
    assert sites >= {"agreement.py _min_over_ranks", "lossy.py gather_expert_full_at", "catalogue.py gather_catalogue",
                     "router.py end_iteration"}


def test_driver_call_sites_follow_the_rule(checker, tmp_path):
    """``should_recover`` / ``last_completed`` / the skipped-entry report of the recovery driver (lead-owned:
    fails until the replacements of docs/communication.md are applied)."""
    from moe_ft.config import FTConfig
    from moe_ft.recovery import driver
    from moe_ft.recovery.progress import last_completed

    assert driver.should_recover(FTConfig(), SimpleNamespace(training=SimpleNamespace(save=""))) == (False, 0)
    assert last_completed(str(tmp_path), "job", 0) == -1
    checker.assert_clean()
    assert {_where(r.site) for r in checker.records} == {"driver.py should_recover", "progress.py last_completed"}


# ------------------------------------------------------------------------------------------ full paths
def _where(site: str) -> str:
    """``"moe_ft/recovery/agreement.py:24 _min_over_ranks"`` → ``"agreement.py _min_over_ranks"``."""
    path, _, func = site.partition(" ")
    return f"{os.path.basename(path.split(':')[0])} {func}"


EXPECTED_A = {  # (function, kind, where the call comes from): the calls that prove each path ran
    ("broadcast", "accelerator", "training.py share_from_last_stage"),  # training with PP = 2: first log line
    ("all_reduce", "accelerator", "training.py loss_func"),
    ("all_gather_into_tensor", "accelerator", "dispatcher.py dispatch_preprocess"),  # flexible dispatcher
    ("broadcast", "accelerator", "elastic_experts.py copy_from_standard"),
    ("all_reduce", "host", "popularity.py end_iteration"),  # every iteration: the counters the policy reads
    ("all_gather_object", "host", "catalogue.py gather_catalogue"),  # the snapshot runtime's build
    ("all_gather_object", "host", "service.py gather"),  # replication layout
    ("send", "host", "transport.py _send"), ("recv", "host", "transport.py _recv"),  # replicas, other node
    ("all_reduce", "host", "driver.py should_recover"),  # the restart after the SIGKILL: recovery
    ("all_reduce", "host", "agreement.py _min_over_ranks"),
    ("all_gather_object", "host", "fetch.py fetch_from_peers"),
    ("all_gather_object", "host", "digest.py global_digest"),
}
EXPECTED_B = {
    ("all_reduce", "host", "router.py end_iteration"),  # the capacity boost after the lossy recovery
    ("all_gather_object", "host", "lossy.py gather_expert_full_at"),
    ("all_reduce", "host", "agreement.py _min_over_ranks"),
}


def _launch(tmp_path, corpus, name: str, flags: list[str], faults: list[str]) -> list[dict]:
    """One torchrun job (4 ranks, one restart allowed) of ``tests/_workers_comm.py``; returns every worker's
    records (all attempts)."""
    import shutil
    import subprocess
    import sys

    from moe_ft.cli.drill import TINY

    out = tmp_path / name
    check_dir = out / "check"
    check_dir.mkdir(parents=True)
    store = f"/dev/shm/moe_ft_comm_{os.getpid()}_{name}"
    env = dict(os.environ, OMP_NUM_THREADS="1", MOE_FT_COMM_CHECK_DIR=str(check_dir),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "moe_ft.drills.prelaunch", "--standalone", "--nproc-per-node=4", "--max-restarts=1",
           "--monitor-interval=1", os.path.join(ROOT, "tests", "_workers_comm.py"), *TINY, "--data-path", corpus,
           "--train-iters", "6", "--ft", "--ft-store-dir", store, "--ft-job-id", name,
           "--ft-digest-out", str(out / "digest.json"), *flags, "--ft-fail", *faults]
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=280)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    assert proc.returncode == 0, f"job {name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return read_logs(sorted(glob.glob(str(check_dir / "*.jsonl"))))


def _check(records: list[dict], expected: set) -> None:
    bad = sorted({f"{r['fn']} at {r['caller']} (from {r['site']}) on {r['group']}: {r['violation']}"
                  for r in records if r["violation"]})
    assert not bad, "collectives breaking the communication rule:\n" + "\n".join(bad)
    seen = {(r["fn"], r["kind"], _where(r["site"])) for r in records}
    assert expected <= seen, f"paths not exercised: {sorted(expected - seen)}"
    assert any(r["rank"] >= 0 and r["caller"].startswith("moe_ft/comm.py") for r in records)


@pytest.mark.multiproc
@pytest.mark.timeout(320)
def test_sparse_pp2_flexible_replication_recovery(tmp_path, corpus):
    """EP2 x PP2, flexible dispatcher with replicated experts, sparse snapshots replicated to the other
    simulated node (2 ranks per node), rank 1 SIGKILLed in iteration 3, torchrun restarts, recovery."""
    records = _launch(tmp_path, corpus, "A", [
        "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--moe-token-dispatcher-type", "flexible", "--ft-expert-replicas", "2", "1", "1", "2",
        "--ft-expert-slots", "3", "--ft-policy", "sparse", "--ft-sparse-window", "2",
        "--ft-replicas", "1", "--ft-ranks-per-node", "2"], ["1:3"])
    _check(records, EXPECTED_A)
    restarted = {r["rank"] for r in records if r["site"].endswith(" should_recover")}
    assert restarted == {0, 1, 2, 3}


@pytest.mark.multiproc
@pytest.mark.timeout(320)
def test_lossy_boost_durable_recovery(tmp_path, corpus):
    """DP2 x EP2 with the alltoall dispatcher, ``pec`` with token dropping and the capacity boost, the durable
    tier every iteration, an exception fault on rank 2 in iteration 4, restart, lossy recovery, boost."""
    records = _launch(tmp_path, corpus, "B", [
        "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
        "--moe-expert-capacity-factor", "0.5", "--ft-policy", "pec", "--ft-capacity-boost", "0.1",
        "--ft-persist-interval", "1", "--ft-persist-dir", str(tmp_path / "durable")], ["2:4:forward:exception"])
    _check(records, EXPECTED_B)
    # the durable tier ran (its writers call no collective): points complete on every rank
    assert glob.glob(str(tmp_path / "durable" / "**" / "complete" / "*.json"), recursive=True)
