"""Copies of the embedding and output layers on the neighbouring stages (CheckFree §4.3, last paragraph).

Averaging cannot rebuild the (de-)embedding: "we simply send their weights to the previous and following
stages. Thus in case of a failure the weights can be recovered exactly". In Megatron's layout the
embedding lives on pipeline stage 0 and the output side (final norm + output layer, the ``output``
operator of ``moe_ft/state/naming.py``) on stage L-1, so:

* what is copied: the ``embedding`` operator's tensors (word and position embeddings) to stage 1, and the
  ``output`` operator's tensors (``decoder.final_layernorm.*``, ``output_layer.weight``) to stage L-2 — the
  compute weights only, as in the paper (the copy is weights, not optimizer state: a rebuilt first/last
  stage restarts Adam for them, exactly like the rebuilt layers);
* when it is refreshed: after every optimizer step (the weights are then exact at any iteration recovery
  may agree on); each copy is versioned by its iteration so that recovery can take the copy of the
  agreed point, and versions older than what the caller still needs are pruned (:meth:`CopyStore.prune`);
* how rebuild uses it: the rebuilt first (last) stage copies its swap partner's layers (CheckFree+) and
  restores the embedding (output) bitwise from the copy of the recovery point's iteration
  (:meth:`CopyStore.restore`).

The holder keeps its copies in its node-local directory (a tmpfs), beside, not inside, the snapshot
store: the copies must survive the loss of the *owner's* node and every store of it, and a holder's own
failure is the "two consecutive stages" case the paper excludes (§3). Files use the store's entry format
(``moe_ft/store/codec.py``: raw bytes with a checksum), written to a temporary name and renamed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

import torch

from moe_ft.state.naming import operator_of
from moe_ft.store.codec import read_entry, write_entry

ALGO = "crc32"
COPIED = ("embedding", "output")
_FILE = re.compile(r"^(embedding|output)\.(\d{12})\.([0-9a-f]+)\.entry$")


def copy_holders(num_stages: int) -> dict[str, tuple[int, int]]:
    """``{operator kind: (owner stage, holder stage)}``: the embedding goes from stage 0 to stage 1, the
    output layer from stage L-1 to stage L-2."""
    if num_stages < 2:
        raise ValueError(f"copies of the embedding/output layer need a neighbouring stage: pipeline size "
                         f"{num_stages} has none (without pipeline parallelism there is no stage to lose alone)")
    return {"embedding": (0, 1), "output": (num_stages - 1, num_stages - 2)}


def copies_held_by(stage: int, num_stages: int) -> list[str]:
    return [kind for kind, (_, holder) in copy_holders(num_stages).items() if holder == stage]


def copies_owned_by(stage: int, num_stages: int) -> list[str]:
    return [kind for kind, (owner, _) in copy_holders(num_stages).items() if owner == stage]


def copied_tensors(gpt, kind: str) -> dict[str, torch.Tensor]:
    """The live tensors of operator ``kind`` (``embedding`` or ``output``) of one stage's ``GPTModel``
    (unwrapped or DDP-wrapped), by parameter name; empty on a stage that does not hold it."""

    if kind not in COPIED:
        raise ValueError(f"only {COPIED} are copied to neighbouring stages, not {kind!r}")
    gpt = getattr(gpt, "module", gpt)
    prefixes = ("embedding.",) if kind == "embedding" else ("output_layer.", "decoder.final_layernorm.")
    out = {name: p for name, p in gpt.named_parameters() if name.startswith(prefixes)}
    assert all(op is not None and op.kind == kind for op in map(lambda name: operator_of(name, gpt), out)), \
        "naming.py and copied_tensors disagree"
    return out


def restore_tensors(what: str, stored: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor]) -> int:
    """Copy ``stored`` into the live tensors ``into`` (bitwise); names, shapes and dtypes must match exactly
    (``ValueError`` naming the tensor). Returns the bytes copied."""
    if set(stored) != set(into):
        raise ValueError(f"{what} holds {sorted(stored)}, the stage expects {sorted(into)}")
    nbytes = 0
    with torch.no_grad():
        for name, live in into.items():
            src = stored[name]
            if src.shape != live.shape or src.dtype != live.dtype:
                raise ValueError(f"{what}, tensor {name!r}: stored {tuple(src.shape)} {src.dtype}, live "
                                 f"{tuple(live.shape)} {live.dtype}")
            live.copy_(src)
            nbytes += src.numel() * src.element_size()
    return nbytes


class CopyStore:
    """A holder's versioned copies of another stage's embedding/output tensors."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def _entries(self) -> list[tuple[str, int, str, Path]]:
        if not self.directory.is_dir():
            return []
        out = []
        for path in self.directory.iterdir():
            m = _FILE.match(path.name)
            if m:
                out.append((m.group(1), int(m.group(2)), m.group(3), path))
        return sorted(out)

    def iterations(self, kind: str) -> list[int]:
        return [it for k, it, _, _ in self._entries() if k == kind]

    def refresh(self, kind: str, iteration: int, tensors: Mapping[str, torch.Tensor]) -> Path:
        """Store ``tensors`` (the owner's weights after iteration ``iteration``) as the copy of that
        iteration (atomic: write, then rename)."""
        if kind not in COPIED:
            raise ValueError(f"only {COPIED} are copied to neighbouring stages, not {kind!r}")
        if not tensors:
            raise ValueError(f"no tensors given for the {kind} copy of iteration {iteration}")
        self.directory.mkdir(parents=True, exist_ok=True)
        cpu = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}
        tmp = self.directory / f".{kind}.{iteration:012d}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            written = write_entry(f.write, self._key(kind, iteration), cpu, ALGO)
            f.flush()
            os.fsync(f.fileno())
        final = self.directory / f"{kind}.{iteration:012d}.{written.checksum}.entry"
        for old_kind, old_it, _, path in self._entries():  # a re-run iteration replaces its copy
            if (old_kind, old_it) == (kind, iteration) and path != final:
                path.unlink(missing_ok=True)
        os.replace(tmp, final)
        return final

    def load(self, kind: str, iteration: int) -> dict[str, torch.Tensor]:
        """The verified copy of ``kind`` taken after ``iteration`` (``KeyError`` naming what exists)."""
        for k, it, checksum, path in self._entries():
            if (k, it) == (kind, iteration):
                with open(path, "rb") as f:
                    entry = read_entry(f, size=path.stat().st_size, checksum=checksum, algo=ALGO,
                                       key=self._key(kind, iteration), where=str(path))
                return entry.tensors
        raise KeyError(f"no {kind} copy of iteration {iteration} in {self.directory} (copies of iterations "
                       f"{self.iterations(kind)})")

    def restore(self, kind: str, iteration: int, into: Mapping[str, torch.Tensor]) -> int:
        """Copy the stored ``kind`` copy of ``iteration`` into the live tensors ``into`` (bitwise); returns
        the bytes restored. Names, shapes and dtypes must match exactly."""
        return restore_tensors(f"the {kind} copy", self.load(kind, iteration), into)

    def prune(self, keep_from: int) -> None:
        """Drop copies of iterations before ``keep_from`` (older than any point recovery could agree on),
        but never a kind's newest copy."""
        entries = self._entries()
        newest = {k: max(it for kk, it, _, _ in entries if kk == k) for k, _, _, _ in entries}
        for kind, it, _, path in entries:
            if it < keep_from and it != newest[kind]:
                path.unlink(missing_ok=True)

    def discard_after(self, iteration: int) -> None:
        """Drop copies after ``iteration`` (an abandoned timeline, after a recovery resumed there)."""
        for _, it, _, path in self._entries():
            if it > iteration:
                path.unlink(missing_ok=True)

    @staticmethod
    def _key(kind: str, iteration: int) -> dict:
        return {"checkfree_copy": kind, "iteration": iteration}
