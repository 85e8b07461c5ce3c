"""Algorithm 3 of MoEtion (§5.2) on the replication stream: the owner's sender replaces the FULL entry of
an expert that continues a stable period by the gradients of its step; the peer's receiver replays the
step on its copy and puts the FULL entry back into the point before verifying and publishing it
(``optim_recompute.py`` has the algorithm, the capture and the shadow update).

Wire format: the point's :class:`PointMessage` as before, minus the replaced entries, plus

* ``recompute/index.json``: ``{"algo": a, "ops": {"<op>": {"blob", "nbytes", "checksum"}}}``;
* ``recompute/<op>``: one store entry (``codec.write_entry``, key ``{"iteration", "operator",
  "kind": "gradients"}``) holding each parameter's gradient, its meta ``{"params": {name: {"optimizer",
  "hyper", "state_keys", "grad"}}}`` — checksummed like every entry, verified on arrival.

Continuity, as Algorithm 3 needs it, is judged on what actually went over the wire: an expert is sent as
gradients only if the previous message of this stream was point ``t - 1`` and carried that expert (as its
FULL entry or as gradients), so skipped or deferred points (``--ft-replication-bandwidth``) and a fresh
sender (a restarted process) start a new stable period with the FULL state. The receiver applies
gradients only to a shadow at ``t - 1`` and checks the rebuilt entry against the owner's checksum; a
mismatch is rejected like a corrupt entry and the shadow dropped (``failures``).
"""

from __future__ import annotations

import io
import json
import logging
import time
from dataclasses import dataclass, replace

import torch

from moe_ft.replication.optim_recompute import GRADIENTS, GradCapture, ParamGrad, ShadowExpert, transfer_types
from moe_ft.replication.receiver import ReplicaReceiver
from moe_ft.replication.sender import ReplicaSender
from moe_ft.replication.transport import PointMessage
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store.backend import MANIFEST
from moe_ft.store.codec import read_entry, write_entry
from moe_ft.store.errors import CorruptEntryError
from moe_ft.store.manifest import decode_manifest

logger = logging.getLogger("moe_ft.replication")

INDEX = "recompute/index.json"
OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


def _key(iteration: int, op: OperatorId) -> dict:
    return {"iteration": iteration, "operator": str(op), "kind": "gradients"}


def _json_hyper(hyper: dict) -> dict:
    out = {}
    for k, v in hyper.items():
        if isinstance(v, tuple):
            v = list(v)
        if not (v is None or isinstance(v, (bool, int, float, str, list))):
            raise ValueError(f"optimizer hyperparameter {k}={v!r} ({type(v).__name__}) cannot be sent to the peer; "
                             "--ft-optimizer-recompute needs plain numbers (no tensor learning rate)")
        out[k] = v
    return out


def encode_gradients(iteration: int, grads: dict[OperatorId, dict[str, ParamGrad]], classes: dict[OperatorId, str],
                     algo: str) -> dict[str, bytes]:
    """The ``recompute/*`` blobs of point ``iteration`` (empty without gradients)."""
    if not grads:
        return {}
    blobs, index = {}, {}
    for op, params in sorted(grads.items(), key=lambda kv: str(kv[0])):
        meta = {"params": {name: {"optimizer": classes[op], "hyper": _json_hyper(pg.hyper),
                                  "state_keys": list(pg.state_keys), "grad": pg.grad is not None}
                           for name, pg in params.items()}}
        tensors = {name: pg.grad.contiguous() for name, pg in params.items() if pg.grad is not None}
        parts: list[bytes] = []
        written = write_entry(lambda b: parts.append(bytes(b)), _key(iteration, op), tensors, algo, meta)
        name = f"recompute/{op}"
        blobs[name] = b"".join(parts)
        index[str(op)] = {"blob": name, "nbytes": written.nbytes, "checksum": written.checksum}
    blobs[INDEX] = json.dumps({"algo": algo, "ops": index}, sort_keys=True).encode()
    return blobs


def decode_gradients(iteration: int, blobs: dict[str, bytes]) -> dict[OperatorId, tuple[type, dict[str, ParamGrad]]]:
    """Inverse of :func:`encode_gradients` (pops the ``recompute/*`` blobs); raises ``CorruptEntryError``."""
    if INDEX not in blobs:
        return {}
    index = json.loads(blobs.pop(INDEX))
    out = {}
    for op_text, rec in index["ops"].items():
        op, data = OperatorId.parse(op_text), blobs.pop(rec["blob"])
        decoded = read_entry(io.BytesIO(data), size=len(data), checksum=rec["checksum"], algo=index["algo"],
                             key=_key(iteration, op), where=f"gradients of {op} iteration {iteration}")
        params, classes = {}, set()
        for name, m in decoded.header["meta"]["params"].items():
            hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in m["hyper"].items()}
            params[name] = ParamGrad(decoded.tensors[name] if m["grad"] else None, hyper, tuple(m["state_keys"]))
            classes.add(m["optimizer"])
        if len(classes) != 1 or next(iter(classes)) not in OPTIMIZERS:
            raise CorruptEntryError(rec["blob"], f"optimizer classes {sorted(classes)}; expected one of "
                                                 f"{sorted(OPTIMIZERS)}")
        out[op] = (OPTIMIZERS[classes.pop()], params)
    return out


@dataclass(frozen=True)
class RecomputeRecord:
    """One sent point: experts sent as FULL entries / as gradients, and the bytes of each (per peer)."""

    iteration: int
    num_full: int
    num_gradients: int
    full_bytes: int
    """FULL expert entries sent."""
    gradient_bytes: int
    """``recompute/*`` blobs sent."""
    replaced_bytes: int
    """FULL expert entries the gradients stand for (what the point would have cost without Algorithm 3)."""


class RecomputeSender(ReplicaSender):
    """:class:`ReplicaSender` that sends continuing experts as gradients (Algorithm 3)."""

    def __init__(self, *args, capture: GradCapture, **kwargs) -> None:
        self.capture = capture
        self.records: list[RecomputeRecord] = []
        self._last: tuple[int, frozenset[OperatorId]] | None = None  # newest message: (point, its experts)
        self._composition: dict[int, tuple[frozenset[OperatorId], RecomputeRecord]] = {}
        self._classes = {op: type(next(iter(p.values())).inner).__name__ for op, p in capture.params.items()}
        self.lost: list[tuple[int, OperatorId]] = []
        """(iteration, expert) whose FULL state was left to the peers but could not be sent."""
        super().__init__(*args, **kwargs)  # starts the sender thread

    @property
    def last_sent(self) -> tuple[int, frozenset[OperatorId]] | None:
        """The newest point sent and the experts it carried (as FULL entries or gradients)."""
        return self._last

    def reset(self) -> None:
        """Forget what was sent (after a rollback the peers dropped their shadows: every expert's next
        point goes FULL again)."""
        self._last = None

    def _read(self, iteration: int) -> PointMessage:
        backend = self.store.backend
        with self.store.pin([iteration]):
            manifest = backend.read_blob(iteration, MANIFEST)
            record = decode_manifest(manifest, iteration, f"{backend.describe()} iteration {iteration}")
            chosen = self._chosen(iteration, record)
            # FULL entries held by the peers only always go (as gradients), whatever the deduplication says
            chosen += [e for e in record.entries.values() if e.remote and e not in chosen]
            experts = {e.op: e for e in chosen if e.op is not None and e.op.is_expert and e.level == Level.FULL}
            last = self._last
            previous = last[1] if last is not None and last[0] == iteration - 1 else frozenset()
            kinds = transfer_types(previous, experts)
            grads = self.capture.take(iteration, [op for op, k in kinds.items() if k == GRADIENTS])
            for op in [op for op, e in experts.items() if e.remote and op not in grads]:
                # The owner wrote only the compute weights, counting on this message (the rule in
                # Replication.remote_full); without the gradients this FULL state exists nowhere now.
                del experts[op]
                self.lost.append((iteration, op))
                logger.error("moe-ft optimizer recomputation rank %d: %s of iteration %d could not be sent as "
                             "gradients and the owner holds only its compute weights; a recovery needs an "
                             "older FULL entry of it", self.owner, op, iteration)
            blobs = {e.blob: backend.read_blob(iteration, e.blob) for e in chosen
                     if e.op not in grads and (e.op is None or e.op in experts or not e.remote)}
        extra = encode_gradients(iteration, grads, self._classes, record.checksum_algo)
        blobs.update(extra)
        full = [op for op in experts if op not in grads]
        self._composition[iteration] = (frozenset(experts), RecomputeRecord(
            iteration, len(full), len(grads), sum(experts[op].nbytes for op in full), sum(map(len, extra.values())),
            sum(experts[op].nbytes for op in grads)))
        return PointMessage(owner=self.owner, iteration=iteration, manifest=manifest, blobs=blobs)

    def _send(self, message: PointMessage, start: float) -> int:
        nbytes = super()._send(message, start)
        experts, rec = self._composition.pop(message.iteration)
        self._last = (message.iteration, experts)
        self.records.append(rec)
        self._composition = {it: c for it, c in self._composition.items() if it > message.iteration}
        self.capture.release(message.iteration)
        return nbytes

    def close(self) -> None:
        super().close()
        self.capture.close()


class RecomputeReceiver(ReplicaReceiver):
    """:class:`ReplicaReceiver` that keeps a :class:`ShadowExpert` of every expert its sources sent in their
    newest point and rebuilds the FULL entries sent as gradients."""

    def __init__(self, *args, **kwargs) -> None:
        self.shadows: dict[int, dict[OperatorId, ShadowExpert]] = {}
        self.recomputed: list[tuple[int, int, OperatorId]] = []  # (owner, iteration, op)
        self.failures: list[tuple[int, int, OperatorId, str]] = []
        self.seconds = 0.0
        """Time spent replaying optimizer steps and encoding the rebuilt entries (this rank's CPU, off the
        training thread)."""
        super().__init__(*args, **kwargs)  # starts the receiving threads

    def reset(self) -> None:
        """Forget every shadow (after a rollback: the next point of each expert must be FULL again)."""
        for owner in list(self.shadows):
            self.shadows[owner] = {}

    def _fail(self, owner: int, it: int, op: OperatorId, reason: str) -> None:
        with self._lock:
            self.failures.append((owner, it, op, reason))
        logger.warning("moe-ft optimizer recomputation of rank %d's %s at iteration %d failed: %s", owner, op, it,
                       reason)

    def _accept(self, store, message: PointMessage) -> None:
        owner, it = message.owner, message.iteration
        blobs = dict(message.blobs)
        shadows = self.shadows.get(owner, {})
        try:
            record = decode_manifest(message.manifest, it, f"replica of rank {owner} iteration {it}")
            grads = decode_gradients(it, blobs)
        except (CorruptEntryError, ValueError, KeyError) as exc:
            record, grads = None, {}
            blobs = {k: v for k, v in blobs.items() if not k.startswith("recompute/")}
            logger.warning("moe-ft replica of rank %d iteration %d: gradients unusable: %r", owner, it, exc)
        produced: dict[OperatorId, ShadowExpert] = {}
        for op, (cls, params) in grads.items():
            shadow, entry = shadows.get(op), record.entries.get(op)
            if shadow is None or entry is None or entry.level != Level.FULL or shadow.iteration != it - 1:
                self._fail(owner, it, op, "no state at the previous iteration to apply the gradients to")
                continue
            start = time.perf_counter()
            try:
                shadow.apply(it, params, cls)
            except (ValueError, RuntimeError) as exc:
                self._fail(owner, it, op, repr(exc))
                continue
            blobs[entry.blob] = shadow.encode(record.checksum_algo)
            produced[op] = shadow
            with self._lock:
                self.seconds += time.perf_counter() - start
        before = len(self.rejections)
        super()._accept(store, replace(message, blobs=blobs))
        rejected = {r.entry for r in self.rejections[before:] if r.owner == owner and r.iteration == it}
        kept: dict[OperatorId, ShadowExpert] = {}
        for op, entry in ({} if record is None or "MANIFEST" in rejected else record.entries).items():
            if not op.is_expert or entry.level != Level.FULL or entry.blob not in blobs:
                continue
            if entry.name in rejected:
                if op in produced:
                    self._fail(owner, it, op, "the recomputed entry differs from the owner's (checksum)")
                continue
            if op in produced:
                kept[op] = produced[op]
                with self._lock:
                    self.recomputed.append((owner, it, op))
            else:
                kept[op] = ShadowExpert.from_entry(op, it, blobs[entry.blob], checksum=entry.checksum,
                                                   algo=record.checksum_algo)
        self.shadows[owner] = kept
