"""Operators: the unit of checkpointing.

An operator is ``expert(layer, e)`` (``e`` a *global* expert index), ``gate(layer)`` (router weight and
expert bias), ``dense(layer)`` (attention + norms of the layer: everything non-expert), ``embedding`` or
``output``. Each has three kinds of state: compute weights, fp32 master weights and optimizer state.
A snapshot plan maps operators to a :class:`Level`. Policies produce plans; the snapshot engine executes
them. This module holds only the vocabulary shared by both sides; it imports nothing from torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Mapping

KINDS = ("embedding", "dense", "gate", "expert", "output")


class Level(enum.IntEnum):
    """How much of an operator a snapshot holds. Ordered: ``FULL > COMPUTE > NONE``."""

    NONE = 0
    COMPUTE = 1  # compute weights only (what forward/backward read)
    FULL = 2  # compute + fp32 master weights + optimizer state


@dataclass(frozen=True, order=True)
class OperatorId:
    """Identity of an operator. ``layer`` is the global (0-based) transformer layer index; ``expert``
    the global expert index. Use the constructors below rather than building ids by hand."""

    kind: str
    layer: int = -1
    expert: int = -1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown operator kind {self.kind!r}; expected one of {KINDS}")
        needs_layer = self.kind in ("dense", "gate", "expert")
        if needs_layer != (self.layer >= 0):
            raise ValueError(f"operator kind {self.kind!r} {'needs' if needs_layer else 'takes no'} layer")
        if (self.kind == "expert") != (self.expert >= 0):
            raise ValueError("only 'expert' operators carry an expert index")

    @staticmethod
    def embedding() -> "OperatorId":
        return OperatorId("embedding")

    @staticmethod
    def output() -> "OperatorId":
        return OperatorId("output")

    @staticmethod
    def dense(layer: int) -> "OperatorId":
        return OperatorId("dense", layer)

    @staticmethod
    def gate(layer: int) -> "OperatorId":
        return OperatorId("gate", layer)

    @staticmethod
    def expert_op(layer: int, expert: int) -> "OperatorId":
        return OperatorId("expert", layer, expert)

    @property
    def is_expert(self) -> bool:
        return self.kind == "expert"

    def __str__(self) -> str:  # stable, file-name safe: used as store keys
        if self.kind == "expert":
            return f"expert.L{self.layer}.E{self.expert}"
        if self.layer >= 0:
            return f"{self.kind}.L{self.layer}"
        return self.kind

    @staticmethod
    def parse(text: str) -> "OperatorId":
        """Inverse of ``str()``: ``expert.L3.E7``, ``gate.L0``, ``embedding`` …"""
        parts = text.split(".")
        try:
            if parts[0] == "expert" and len(parts) == 3:
                return OperatorId("expert", int(parts[1][1:]), int(parts[2][1:]))
            if len(parts) == 2:
                return OperatorId(parts[0], int(parts[1][1:]))
            if len(parts) == 1:
                return OperatorId(parts[0])
        except ValueError:
            pass
        raise ValueError(f"cannot parse operator id {text!r}")


@dataclass(frozen=True, kw_only=True)
class OperatorInfo:
    """What a policy may know about an operator: its identity, where it lives and its byte sizes.

    ``bytes_compute``: bytes of the compute weights held by this rank; ``bytes_full``: compute + master +
    optimizer bytes held by this rank (with the distributed optimizer only this rank's shard of master
    and optimizer state). ``ep_rank`` / ``pp_rank``: the expert- and pipeline-parallel rank holding it.
    """

    op: OperatorId
    bytes_compute: int
    bytes_full: int
    ep_rank: int = 0
    pp_rank: int = 0

    def nbytes(self, level: Level) -> int:
        if level == Level.FULL:
            return self.bytes_full
        if level == Level.COMPUTE:
            return self.bytes_compute
        return 0


SnapshotPlan = Mapping[OperatorId, Level]
"""A plan for one iteration: operator → level. Operators absent from the mapping are ``NONE``."""
