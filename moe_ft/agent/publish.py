"""Publishing by the node agent (``--ft-publish-by agent``): the trainer copies, the agent seals and publishes.

The trainer's snapshot thread copies each tensor into its region of the arena (its one touch of the payload,
none on a GPU) and hands the point to the node agent (``moe_ft/store/handoff.py``): the agent writes each
entry's header and digest from the lane sums the copy produced, the manifest and the index, and collects the
rank's garbage, in its own process; the trainer's snapshot thread waits for the answer in a system call (the
GIL released) and then only gives the point's regions to it. This is the host work the training thread of a
GPU job waits behind for the GIL (``docs/benchmarks.md``).

The connection is this publisher's own (the agent answers each connection on a thread of its own, in order),
and the agent keeps the entry layouts and the retention policy it was sent: an order names them by number.
An agent started again after a crash lacks them and says so; the order is then sent with all of them.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import replace
from typing import Any

from moe_ft.agent.client import AgentClient, AgentCpu
from moe_ft.store import SnapshotStore
from moe_ft.store.codec import EntryLayout
from moe_ft.store.handoff import EntryKind, MissingState, PublishOrder
from moe_ft.store.retention import RetentionPolicy
from moe_ft.store.rules import SparseWindowRule


class AgentPublisher:
    """Rank ``rank``'s points, published by the node agent of ``agent_dir`` (the store's
    :attr:`~moe_ft.store.SnapshotStore.publisher`)."""

    _ids = itertools.count(1)

    def __init__(self, store: SnapshotStore, *, rank: int, agent_dir: str | os.PathLike,
                 idle_exit_s: float = 600.0) -> None:
        if not getattr(store.backend, "maps_regions", False):
            raise ValueError(f"--ft-publish-by agent needs the arena store layout; {store.backend.describe()} is not "
                             "one (--ft-store-layout arena)")
        self.rank = rank
        self.client = AgentClient(agent_dir, rank, idle_exit_s=idle_exit_s)
        self.client.call("ping")  # start (or find) the agent now, not at the first publish
        self.agent_cpu = AgentCpu()
        self.published = 0
        self._agent: int | None = None  # the agent that holds what was sent
        self._kinds: set[int] = set()
        self._layouts: set[int] = set()
        # the policy last sent (kept: its id is not given to another while it is compared), its windows, its number
        self._retention: tuple[RetentionPolicy | None, tuple | None, int] = (None, None, 0)
        store.publisher = self
        store.shared_pins = True  # the agent's garbage collection must see this process's readers
        self.store = store

    def publish(self, order: PublishOrder, kinds: list[tuple[EntryKind, EntryLayout]],
                retention: RetentionPolicy | None) -> dict[str, Any]:
        """Send ``order`` with what the agent lacks of its entries' ``kinds`` and layouts and of ``retention``;
        returns its answer once the point is published."""
        for attempt in (0, 1):
            if attempt or self.client.pid != self._agent:
                self._kinds.clear()
                self._layouts.clear()
                self._retention = (None, None, 0)
            order.kinds = {id(kind): kind for kind, _ in kinds if id(kind) not in self._kinds}
            order.layouts = {kind.layout: layout for kind, layout in kinds
                             if id(kind) in order.kinds and kind.layout not in self._layouts} if order.kinds else {}
            sent, sent_windows, number = self._retention
            windows = self._windows(retention, order.iteration)
            if retention is None:
                order.retention, order.retention_id = None, 0
            elif sent is retention and sent_windows == windows:
                order.retention, order.retention_id = None, number
            else:
                order.retention, order.retention_id = self._portable(retention, windows), next(self._ids)
            try:
                answer = self.client.call("publish", order)
            except RuntimeError as exc:
                if isinstance(exc.__cause__, MissingState) and not attempt:
                    continue  # an agent started again since: send everything
                if isinstance(exc.__cause__, OSError):
                    raise exc.__cause__ from None  # e.g. a full store: the engine pauses snapshots
                raise
            self._agent = self.client.pid
            self._kinds.update(order.kinds)
            self._layouts.update(order.layouts)
            self._retention = (retention, windows, order.retention_id)
            self.published += 1
            self.agent_cpu.take(order.iteration, answer["cpu_s"])
            return answer
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _windows(self, retention: RetentionPolicy | None, iteration: int) -> tuple | None:
        """For a sparse rule (whose windows are read from the live policy): the windows ending at the store's
        points and at ``iteration`` (the ends garbage collection will ask about); ``None`` for a rule that is
        plain data (sent again only when the store gets another policy)."""
        rule = getattr(retention, "rule", None)
        if not isinstance(rule, SparseWindowRule):
            return None
        return tuple(w for end in [*self.store.points(), iteration] if (w := rule.window_of(end)) is not None)

    @staticmethod
    def _portable(retention: RetentionPolicy, windows: tuple | None) -> RetentionPolicy:
        """``retention`` as data the agent can be sent (a sparse rule as its windows: ``portable``)."""
        if windows is None:
            return retention
        rule = retention.rule  # type: ignore[attr-defined]  # _windows found a sparse rule
        return replace(retention, rule=SparseWindowRule.explicit(  # type: ignore[type-var]  # a dataclass
            rule.operators, windows, require_meta=rule.require_meta))

    def metrics(self) -> dict:
        out: dict[str, float] = {"agent_published": self.published}
        if (ms := self.agent_cpu.ms_per_iteration()) is not None:
            out["agent_cpu_ms"] = ms  # the node agent's CPU (publishing, and what else it does for the node)
        return out

    def close(self) -> None:
        """After the engine's last point: the agent may leave once every rank said bye."""
        self.store.publisher = None
        self.client.bye()
