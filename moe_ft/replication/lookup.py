"""Where recovery reads an entry from, and why. Every copy is verified on load; a copy
that is missing or fails its checksum is never used.

Lookup order for one entry (``find_entry``): the rank's node-local store, then each peer replica in
placement order, then — if allowed — the durable tier: the order MoEvement §3.2 and MoC §5.1 give (memory
is fast, durable storage is the last resort). With ``include_durable=False`` an entry without a valid
in-memory copy raises ``NoValidEntryError``, which says why. The chosen source and the reasons the earlier
ones were skipped are logged (logger ``moe_ft.replication``) and returned. A lookup of one entry, for tools
and tests: recovery itself fetches a lost node's entries from the peers first
(``moe_ft/replication/fetch.py``) and falls back from memory to the durable tier point by point
(``moe_ft/recovery/driver.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import SnapshotStore
from moe_ft.store.errors import CorruptEntryError, MissingEntryError, StoreError

logger = logging.getLogger("moe_ft.replication")


class NoValidEntryError(StoreError):
    """No source holds a verified copy of the entry; ``tried`` lists ``(source, reason)``."""

    def __init__(self, what: str, tried: Sequence[tuple[str, str]]) -> None:
        reasons = "; ".join(f"{name}: {why}" for name, why in tried) or "no sources configured"
        super().__init__(f"no valid copy of {what} ({reasons}); recover from an older point or the durable tier")
        self.tried = tuple(tried)


@dataclass(frozen=True)
class EntrySource:
    """A verified copy: where it came from, its tensors, and why earlier sources were skipped."""

    source: str
    iteration: int
    tensors: dict[str, torch.Tensor]
    skipped: tuple[tuple[str, str], ...]


@dataclass(kw_only=True)
class EntryLocator:
    """The sources of one rank's entries, in lookup order."""

    local: SnapshotStore | None = None
    """The rank's node-local store (gone after a node loss)."""
    replicas: Sequence[tuple[str, SnapshotStore]] = ()
    """``(name, store)`` of the peer replicas, in placement order (e.g. ``("replica@rank2", store)``)."""
    durable: SnapshotStore | None = None
    """The rank's part of the durable tier (``DurableTier.store(rank)``)."""

    def sources(self, include_durable: bool) -> list[tuple[str, SnapshotStore]]:
        out = [("local", self.local)] if self.local is not None else []
        out += list(self.replicas)
        if include_durable and self.durable is not None:
            out.append(("durable", self.durable))
        return out

    def find_entry(self, op: OperatorId | None, level: Level | None, iteration: int, *,
                   include_durable: bool = True) -> EntrySource:
        """The first verified copy of entry (``iteration``, ``op``, ``level``); ``op=None`` is the metadata
        entry. Raises :class:`NoValidEntryError` naming every source and why it was skipped."""
        what = f"{'metadata' if op is None else f'{op}@{Level(level).name}'} of iteration {iteration}"
        skipped: list[tuple[str, str]] = []
        for name, store in self.sources(include_durable):
            try:
                if op is None:
                    entry = store.load_meta(iteration)
                    tensors = dict(entry.tensors, **{"__meta__": entry.meta})  # type: ignore[arg-type]
                else:
                    tensors = store.load(iteration, op, level)
            except MissingEntryError:
                skipped.append((name, "missing"))
                continue
            except CorruptEntryError as exc:
                skipped.append((name, exc.reason))
                continue
            if skipped:
                logger.warning("moe-ft recovery: %s from %s (%s)", what, name,
                               "; ".join(f"{n}: {why}" for n, why in skipped))
            return EntrySource(source=name, iteration=iteration, tensors=tensors, skipped=tuple(skipped))
        raise NoValidEntryError(what, skipped)
