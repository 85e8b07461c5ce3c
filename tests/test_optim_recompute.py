"""Asynchronous optimizer recomputation on the replica peer (MoEtion §5.2, Algorithm 3;
``moe_ft/replication/optim_recompute.py``, ``recompute_stream.py``).

* Algorithm 3's decision as a pure function;
* the real Megatron optimizer (tiny MoE GPT, one rank, gradient clipping active): a peer's shadow fed the
  captured gradients equals the owner's state bitwise (param, ``exp_avg``, ``exp_avg_sq``, ``step`` and the
  encoded FULL entry) over several iterations, through a selection change that retransmits the state;
* the replication stream (in-process transport, in-memory stores): continuing experts travel as gradients,
  the peer's replica holds the owner's FULL entries byte for byte, a gap restarts the stable period, a
  wrong gradient is caught by the owner's checksum;
* flag validation.
"""

from __future__ import annotations

import pytest
import torch

from megatron.training.extensions import LoopExtension
from moe_ft.replication import InProcessHub, ReceiverConfig, SenderConfig
from moe_ft.replication.optim_recompute import (
    GRADIENTS,
    OPTIMIZER_MODEL,
    GradCapture,
    MainParam,
    ShadowExpert,
    transfer_types,
)
from moe_ft.replication.recompute_stream import RecomputeReceiver, RecomputeSender, decode_gradients, encode_gradients
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import MemoryBackend, SnapshotStore
from moe_ft.store.codec import DEFAULT_CHECKSUM, write_entry
from moe_ft.store.manifest import entry_key
from tests._ft_helpers import tiny_model_flags, torchrun

E = [OperatorId.expert_op(0, e) for e in range(4)]


def test_algorithm3_gradients_only_for_experts_checkpointed_just_before():
    assert transfer_types([E[0], E[1]], [E[1], E[2]]) == {E[1]: GRADIENTS, E[2]: OPTIMIZER_MODEL}
    assert transfer_types([], [E[0]]) == {E[0]: OPTIMIZER_MODEL}
    # f_ckpt > 1: the peer is several steps behind, everything goes as Optimizer+Model (lines 1-6)
    assert transfer_types([E[1]], [E[1]], checkpoint_interval=2) == {E[1]: OPTIMIZER_MODEL}
    with pytest.raises(ValueError, match="checkpoint_interval"):
        transfer_types([], [], checkpoint_interval=0)


def _encode(iteration: int, op: OperatorId, tensors: dict) -> tuple[bytes, str]:
    parts: list[bytes] = []
    written = write_entry(lambda b: parts.append(bytes(b)), entry_key(iteration, op, Level.FULL), tensors,
                          DEFAULT_CHECKSUM)
    return b"".join(parts), written.checksum


def _wire(iteration: int, grads: dict, classes: dict) -> dict:
    """What the peer decodes: the gradients through their wire format."""
    return decode_gradients(iteration, encode_gradients(iteration, grads, classes, DEFAULT_CHECKSUM))


# ------------------------------------------------------------------- the real Megatron optimizer, one rank
MODEL = tiny_model_flags(seq_length=16, global_batch_size=4, train_iters=8, lr_warmup_iters=2,
                         clip_grad="0.05", weight_decay="0.1")
# experts FULL after each iteration: layer 0 expert 1 leaves at 3 and comes back at 5 (retransmission)
SELECTION = [{(0, 0), (0, 1)}, {(0, 0), (0, 1)}, {(0, 0), (0, 1), (1, 2)}, {(0, 0), (1, 2)},
             {(0, 0), (1, 2)}, {(0, 1), (1, 2)}, {(0, 1), (1, 3)}, {(0, 1), (1, 3)}]


class _RouterSpec(LoopExtension):
    def customize_layer_spec(self, spec):
        from moe_ft.megatron_ext.router import install_router

        return install_router(spec)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_shadow_equals_megatron_optimizer_bitwise(corpus, precision, megatron_world):
    """fp32: ``FP32Optimizer`` (the weight is the master); bf16: ``Float16OptimizerWithFloat16Params`` (fp32
    master + bf16 model weight, copied from the master after the step)."""
    from megatron.training.arguments import parse_args
    from megatron.training.initialize import set_seeds
    from megatron.training.model import build_train_state
    from megatron.training.pretrain import build_data
    from megatron.training.training import train_step
    from moe_ft.state.optimizer_views import ensure_optimizer_state
    from moe_ft.state.registry import OperatorRegistry

    capture = None
    try:
        args = parse_args([*MODEL, *precision, "--data-path", corpus], world_size=1)
        args.extra["router"] = _RouterSpec()
        set_seeds(args.training.seed)
        state = build_train_state(args)
        data = build_data(args)
        ensure_optimizer_state(state.optimizer)
        registry = OperatorRegistry.from_megatron(state.model, state.optimizer)
        capture = GradCapture.from_megatron(registry, state.optimizer)
        assert set(capture.params) == {op for op in registry if op.is_expert}
        classes = {op: type(next(iter(p.values())).inner).__name__ for op, p in capture.params.items()}
        assert set(classes.values()) == {"AdamW"}  # what Megatron-Core builds without TE/Apex
        masters = {n for op in capture.params for n in registry[op].master}
        assert bool(masters) == bool(precision)  # bf16: separate fp32 masters in the FULL entry
        shadows: dict[OperatorId, ShadowExpert] = {}
        applied = retransmitted = 0
        previous: set[OperatorId] = set()
        seen: set[OperatorId] = set()
        for t, chosen in enumerate(SELECTION):
            capture.begin(t)
            result = train_step(state, data, t, args)
            assert result.grad_norm > args.training.clip_grad  # clipping scaled the gradients of this step
            current = {OperatorId.expert_op(*le) for le in chosen}
            kinds = transfer_types(previous, current)
            grads = capture.take(t, [op for op, k in kinds.items() if k == GRADIENTS])
            assert set(grads) == {op for op, k in kinds.items() if k == GRADIENTS}
            for op, (cls, params) in _wire(t, grads, classes).items():
                shadows[op].apply(t, params, cls)
                applied += 1
            for op in current:
                live = {name: t_.detach().clone() for name, t_ in registry[op].tensors(Level.FULL).items()}
                data_, checksum = _encode(t, op, live)
                if kinds[op] == OPTIMIZER_MODEL:  # entering (or re-entering) the selection: the whole state
                    retransmitted += op in seen
                    shadows[op] = ShadowExpert.from_entry(op, t, data_, checksum=checksum, algo=DEFAULT_CHECKSUM)
                    continue
                peer = shadows[op].tensors
                assert list(peer) == list(live)
                assert any(n.startswith("exp_avg_sq.") for n in peer) and any(n.startswith("step.") for n in peer)
                for name, want in live.items():
                    assert torch.equal(peer[name], want), (t, op, name)
                assert shadows[op].encode(DEFAULT_CHECKSUM) == data_  # the owner's FULL entry, byte for byte
            shadows = {op: s for op, s in shadows.items() if op in current}
            capture.track(current)
            previous, seen = current, seen | current
        assert applied == 12 and retransmitted == 1  # expert (0, 1) re-entered at iteration 5
    finally:
        if capture is not None:
            capture.close()


# ------------------------------------------------------------------ the replication stream, in process
D0 = OperatorId.dense(0)


class _Owner:
    """A rank's experts under torch AdamW (two parameter groups, clipping), publishing FULL entries of the
    selected experts (+ a dense operator and metadata) after every step, as the snapshot engine does."""

    def __init__(self, store: SnapshotStore) -> None:
        g = torch.Generator().manual_seed(0)
        self.store, self.gen = store, g
        self.params = {op: {f"experts.{op.expert}.fc{i}.weight": torch.randn(8, 4, generator=g) for i in (1, 2)}
                       for op in E}
        flat = [(op, n, p) for op, ps in self.params.items() for n, p in ps.items()]
        self.opt = torch.optim.AdamW([{"params": [p for _, n, p in flat if n.endswith("fc1.weight")]},
                                      {"params": [p for _, n, p in flat if n.endswith("fc2.weight")],
                                       "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1)
        index = {id(p): (gi, p) for gi, grp in enumerate(self.opt.param_groups) for p in grp["params"]}
        self.capture = GradCapture({op: {n: MainParam(self.opt, index[id(p)][0], p) for n, p in ps.items()}
                                    for op, ps in self.params.items()})

    def step(self, t: int) -> None:
        self.capture.begin(t)
        params = [p for ps in self.params.values() for p in ps.values()]
        for p in params:
            p.grad = torch.randn(p.shape, generator=self.gen)
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        self.opt.param_groups[0]["lr"] = 1e-2 / (t + 1)  # the scheduler moves lr between steps
        self.opt.step()

    def full(self, op: OperatorId) -> dict:
        out = dict(self.params[op])
        for n, p in self.params[op].items():
            out.update({f"{k}.{n}": v for k, v in self.opt.state[p].items()})
        return out

    def publish(self, t: int, selected) -> None:
        with self.store.begin(t) as point:
            point.put(D0, Level.FULL, {"w": torch.full((16,), float(t))})
            for op in selected:
                point.put(op, Level.FULL, self.full(op))
            point.put_meta({"iteration": t})
            point.publish()
        self.capture.track(selected)


def _stream():
    hub = InProcessHub()
    owner = _Owner(SnapshotStore(MemoryBackend(name="rank0")))
    replica = SnapshotStore(MemoryBackend(name="replica of rank 0"))
    receiver = RecomputeReceiver(ReceiverConfig(keep_points=16), hub.endpoint(1), [0], lambda o: replica)
    sender = RecomputeSender(SenderConfig(), owner.store, hub.endpoint(0), [1], owner=0, capture=owner.capture)
    return owner, replica, sender, receiver


def test_stream_sends_gradients_and_the_replica_holds_the_owners_entries():
    owner, replica, sender, receiver = _stream()
    selection = [{0, 1}, {0, 1}, {0, 1, 2}, {0, 2}, {0, 2}, {0, 2}, {1, 2}, {1, 2}]
    not_sent = {4}  # a point that never went out (e.g. deferred by the budget): continuity breaks
    for t, chosen in enumerate(selection):
        owner.step(t)
        owner.publish(t, [E[e] for e in chosen])
        if t not in not_sent:
            sender.submit(t)
            sender.flush()
    sender.close()
    receiver.join(timeout=10)
    got = {r.iteration: (r.num_full, r.num_gradients) for r in sender.records}
    # FULL when entering (0: both; 2: expert 2; 6: expert 1) or after the gap (5: all), gradients otherwise
    assert got == {0: (2, 0), 1: (0, 2), 2: (1, 2), 3: (0, 2), 5: (2, 0), 6: (1, 1), 7: (0, 2)}
    assert len(receiver.recomputed) == 9 and not receiver.failures and not receiver.rejections
    assert replica.points() == [t for t in range(8) if t not in not_sent]
    assert not replica.verify().problems
    for t in replica.points():
        for blob in owner.store.backend.blob_names(t):
            if blob.endswith(".ent"):  # every entry, the recomputed FULL ones too, is the owner's file
                assert replica.backend.read_blob(t, blob) == owner.store.backend.read_blob(t, blob), (t, blob)
    saved = sum(r.replaced_bytes - r.gradient_bytes for r in sender.records)
    assert saved > 0 and all(r.gradient_bytes < r.replaced_bytes for r in sender.records if r.num_gradients)


def test_wrong_gradients_are_caught_by_the_owners_checksum():
    owner, replica, sender, receiver = _stream()
    take = owner.capture.take

    def tampered(iteration, ops):  # one bit of state goes wrong on the way at iteration 2
        grads = take(iteration, ops)
        if iteration == 2 and E[0] in grads:
            name = next(iter(grads[E[0]]))
            grads[E[0]][name].grad = grads[E[0]][name].grad * 1.5
        return grads

    owner.capture.take = tampered
    for t in range(4):
        owner.step(t)
        owner.publish(t, [E[0], E[1]])
        sender.submit(t)
        sender.flush()
    sender.close()
    receiver.join(timeout=10)
    reasons = [(it, op, why) for _, it, op, why in receiver.failures]
    assert reasons[0] == (2, E[0], "the recomputed entry differs from the owner's (checksum)")
    assert [(it, op) for it, op, _ in reasons[1:]] == [(3, E[0])]  # no state left to apply the next step to
    assert E[0] not in replica.catalog([2]).point(2).entries and E[1] in replica.catalog([3]).point(3).entries
    assert not replica.verify().problems  # nothing wrong was published


def test_flags_need_replicas_and_the_selective_policy():
    from moe_ft.config import FTConfig

    FTConfig.from_flags(ft=True, ft_policy="selective", ft_optimizer_recompute=True)
    with pytest.raises(ValueError, match="--ft-policy selective"):
        FTConfig.from_flags(ft=True, ft_policy="sparse", ft_optimizer_recompute=True)
    with pytest.raises(ValueError, match="--ft-replicas >= 1"):
        FTConfig.from_flags(ft=True, ft_policy="selective", ft_replicas=0, ft_optimizer_recompute=True)


def test_refuses_optimizers_the_peer_cannot_reproduce():
    from moe_ft.replication.optim_recompute import _supported_inner

    p = torch.zeros(2)
    _supported_inner(torch.optim.Adam([p]))
    with pytest.raises(ValueError, match="run without --ft-optimizer-recompute"):
        _supported_inner(torch.optim.SGD([p], lr=0.1))


# ------------------------------------------------------------------ real tiny model, 4 gloo processes
RUN = [*tiny_model_flags("ep2pp2", num_experts=8, train_iters=10, log_interval=5), "--ft", "--ft-policy",
       "selective", "--ft-ranks-per-node", "2", "--ft-replicas", "1"]
BUDGET = "520000"  # bytes: each rank's non-expert FULL state and 3 of its 4 experts (~100 kB each) per iteration


def _summaries(stdout: str) -> list[tuple[str, ...]]:
    """Each rank's end-of-run line: (rank, experts sent as gradients, as FULL, recomputed for sources, failed)."""
    import re

    return re.findall(r"optimizer recomputation rank (\d): \d+ points sent (\d+) experts as gradients .*? and (\d+) "
                      r"as FULL \([\d.]+ MB\), capture [\d.]+ s; recomputed (\d+) for its sources in [\d.]+ s, "
                      r"(\d+) failed", stdout)


@pytest.mark.multiproc
@pytest.mark.timeout(240)
def test_peer_state_equals_owner_state_in_a_real_run(tmp_path, corpus):
    """EP=2 x PP=2 on two simulated nodes, each rank replicated to one peer on the other node; 3 of each
    rank's 4 experts FULL per iteration, so experts enter, stay and leave the selection. Every entry of
    every replicated point — the FULL entries the peers rebuilt from gradients included — is the owner's
    file byte for byte (param, Adam moments and step of the owner's optimizer after that step)."""
    from moe_ft.store import StoreConfig
    from tests._ft_helpers import held_replica_store

    store = tmp_path / "store"
    proc = torchrun("pretrain_gpt_moe.py", ["--data-path", corpus, *RUN, "--ft-selective-local-budget", BUDGET,
                                            "--ft-store-dir", str(store), "--ft-job-id", "job",
                                            "--ft-optimizer-recompute"], timeout=200)
    lines = _summaries(proc.stdout)
    assert sorted(int(r) for r, *_ in lines) == [0, 1, 2, 3], proc.stdout[-3000:]
    for rank, grads, full, recomputed, failed in lines:  # every stable period starts with a FULL transfer
        assert int(grads) > 0 and int(full) > 4 and failed == "0", lines
    assert sum(int(g) for _, g, *_ in lines) == sum(int(r) for *_, r, _ in lines)  # each one rebuilt by a peer
    compared = 0
    for rank in range(4):
        own = StoreConfig(root=str(store), job_id="job", rank=rank).build()
        replica = held_replica_store(store, "job", rank)
        assert not replica.verify().problems
        common = sorted(set(own.points()) & set(replica.points()))
        assert common, (rank, own.points(), replica.points())
        for it in common:
            mine = own.catalog([it]).point(it)
            for op, entry in mine.entries.items():
                assert replica.backend.read_blob(it, entry.blob) == own.backend.read_blob(it, entry.blob)
                compared += 1
    assert compared


def _flags(corpus) -> list[str]:
    """Every expert FULL every iteration (one stable period)."""
    return ["--data-path", corpus, *RUN, "--ft-selective-local-budget", str(10**12), "--ft-job-id", "job",
            "--ft-optimizer-recompute", "--seed", "7"]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory, corpus):
    """The digest of the fault-free run of :func:`_flags` (optimizer recomputation does not change
    training, whatever the owner keeps locally)."""
    tmp = tmp_path_factory.mktemp("recompute-ref")
    torchrun("pretrain_gpt_moe.py", [*_flags(corpus), "--ft-store-dir", str(tmp / "ref"),
                                     "--ft-digest-out", str(tmp / "ref.json")], timeout=150)
    return (tmp / "ref.json").read_text()


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_lost_node_recovers_from_the_peers_recomputed_state(tmp_path, corpus, fault_free):
    """Every expert FULL every iteration (one stable period), so after iteration 0 every replicated expert
    entry was rebuilt by the peer from gradients. Rank 2 is killed in iteration 6 and node 1 is lost whole
    (ranks 2 and 3's stores, the replicas node 1 held, its progress files): the relaunch rebuilds node 1's
    points from node 0's replicas, recovers from them (selective: each operator's newest FULL, here all at
    one iteration, so nothing is lost) and ends bitwise equal to the fault-free run. (Node 0's ranks survive
    and load their own survivor points; stage 1 replays from node 0's upstream logs.)"""
    import json
    import shutil

    flags = _flags(corpus)
    store = tmp_path / "store"
    killed = torchrun("pretrain_gpt_moe.py", [*flags, "--ft-store-dir", str(store), "--ft-fail", "2:6"],
                      timeout=150, check=False)
    assert killed.returncode != 0
    job = store / "job"
    for lost in ["rank2", "rank3", "replicas/holder2", "replicas/holder3", "survivor/rank2", "survivor/rank3",
                 "upstream/rank2", "upstream/rank3"]:  # node 1 is gone, with everything it held
        shutil.rmtree(job / lost, ignore_errors=lost.startswith("survivor/"))
    for rank in (2, 3):
        (job / f"progress_rank{rank}").unlink()
    reports = tmp_path / "reports"
    proc = torchrun("pretrain_gpt_moe.py", [*flags, "--ft-store-dir", str(store), "--ft-fail", "2:6",
                                            "--ft-recover", "always", "--ft-report-dir", str(reports),
                                            "--ft-digest-out", str(tmp_path / "recovered.json")], timeout=150)
    levels = json.loads((reports / "recovery_000.json").read_text())["recovery_levels"]
    assert levels["level"] == "exact" and not levels["rebuilt"], levels
    # stage 1 (layer 1: node 1's ranks) had no state left but the replicas node 0 held: its points were
    # fetched from them and either loaded ("peer_replica": the whole job resumes at the newest common point)
    # or replayed forward from node 0's logs to the survivors' iteration ("window_replay": localized
    # recovery, when node 0's ranks published survivor points before torchrun stopped them)
    stage1 = {op: how for op, how in levels["operators"].items() if op.endswith("L1") or ".L1." in op}
    assert stage1 and len(set(stage1.values())) == 1, levels
    assert set(stage1.values()) <= {"peer_replica", "window_replay"}, levels
    assert json.loads((tmp_path / "recovered.json").read_text()) == json.loads(fault_free)
    lines = _summaries(proc.stdout)  # after the recovery, recomputation went on against the restored state
    assert len(lines) == 4 and all(int(g) > 0 and f == "0" for _, g, _, _, f in lines), proc.stdout[-3000:]


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_owner_keeping_compute_weights_recovers_from_the_peers_full_state(tmp_path, corpus, fault_free):
    """``--ft-optimizer-recompute-local compute``: after iteration 0 each rank writes only the compute
    weights of its experts (and a checksum of their FULL state); the peers rebuild the FULL entries. Rank 2
    is killed in iteration 6 (a process, not the node: every store survives, with the FULL expert entries
    missing from the owners' points). The relaunch fetches them from the peers into the owners' points,
    recovers from them, and ends bitwise equal to the fault-free run."""
    import json
    import re

    from moe_ft.store import StoreConfig

    flags = [*_flags(corpus), "--ft-optimizer-recompute-local", "compute"]
    store = tmp_path / "store"
    killed = torchrun("pretrain_gpt_moe.py", [*flags, "--ft-store-dir", str(store), "--ft-fail", "2:6"],
                      timeout=150, check=False)
    assert killed.returncode != 0
    for rank in range(4):  # the owners' points lack the FULL entries they left to the peers
        own = StoreConfig(root=str(store), job_id="job", rank=rank).build()
        catalog = own.catalog()
        assert catalog.holes and not catalog.problems, rank
        assert {op for _, op in catalog.holes} == {op for op in catalog.operators() if op.is_expert}, rank
    reports = tmp_path / "reports"
    proc = torchrun("pretrain_gpt_moe.py", [*flags, "--ft-store-dir", str(store), "--ft-fail", "2:6",
                                            "--ft-recover", "always", "--ft-report-dir", str(reports),
                                            "--ft-digest-out", str(tmp_path / "recovered.json")], timeout=150)
    report = json.loads((reports / "recovery_000.json").read_text())
    fetched = report["recovery_point"]["fetched"]
    assert sorted(fetched) == ["0", "1", "2", "3"] and all(f["completed"] for f in fetched.values()), fetched
    # a newest point is used (5, or 4 when rank 2 died before sending 5); its experts' FULL states all came
    # from the peers, and with every expert FULL at every point nothing is lost
    end = report["recovery_point"]["end"]
    assert end in (4, 5) and report["token_loss"]["tokens"] == 0.0, report
    # (failed once in CI under load, not reproduced in 11 runs alone and 3 at a time: rank 0 completed only
    # point 4 while the job recovered at 5; the whole recovery point and levels are in the message for the
    # next time)
    assert all(end in f["completed"] for f in fetched.values()), (fetched, report["recovery_point"],
                                                                  report.get("recovery_levels"))
    assert json.loads((tmp_path / "recovered.json").read_text()) == json.loads(fault_free)
    ends = [int(n) for n in re.findall(r"compute weights only for (\d+) expert snapshots, 0 lost", proc.stdout)]
    assert len(ends) == 4 and all(n > 0 for n in ends), proc.stdout[-3000:]


def test_remote_budget_skips_points_and_gradients_stay_consistent():
    """``--ft-replication-bandwidth``: points that do not fit the credit are never sent; the stream decides
    gradients vs FULL on what was actually sent, so the peer never gets gradients for a state it lacks."""
    owner, replica, sender, receiver = _stream()
    sender.budget = lambda: 4_000  # bytes per submitted iteration; a point is ~6.3 kB with both experts FULL,
    for t in range(12):  # ~5.4 kB with both as gradients (headers dominate these small entries)
        owner.step(t)
        owner.publish(t, [E[0], E[1]])
        sender.submit(t)
        sender.flush()
    sender.close()
    receiver.join(timeout=10)
    sent = [r.iteration for r in sender.records]
    assert len(sent) >= 4 and set(range(12)) - set(sent), sent  # some points skipped (deferred)
    grads = [r.iteration for r in sender.records if r.num_gradients]
    assert grads and all(it - 1 in sent for it in grads)  # gradients only right after a sent point
    assert not receiver.failures and len(receiver.recomputed) == sum(r.num_gradients for r in sender.records)
    for t in replica.points():
        for blob in owner.store.backend.blob_names(t):
            if blob.endswith(".ent"):
                assert replica.backend.read_blob(t, blob) == owner.store.backend.read_blob(t, blob), (t, blob)
