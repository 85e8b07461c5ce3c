"""The global operator catalogue the policies plan over (``docs/policies.md``: every rank builds the same
policy from the same global list).

Every rank contributes its registry's :class:`OperatorInfo` list; the lists are all-gathered and merged
per operator:

* byte sizes: the largest over the ranks holding the operator (with the distributed optimizer each
  data-parallel rank holds a different shard; a plan must fit the fullest one);
* ``pp_rank``: the stage holding it; ``ep_rank``: for an expert, the expert-parallel rank holding it; for a
  non-expert operator (replicated over the stage's EP ranks) round-robin over the stage's EP ranks in
  OperatorId order (MoC §4.2), so that the policies' per-device byte budgets spread them.

The merge is a pure function (:func:`merge_catalogue`), testable without a process group.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from moe_ft.state.operators import OperatorId, OperatorInfo


def merge_catalogue(per_rank: Iterable[Sequence[OperatorInfo]], ep_size: int) -> list[OperatorInfo]:
    """Merge the ranks' local lists into one :class:`OperatorInfo` per operator, sorted by OperatorId."""
    merged: dict[OperatorId, list[OperatorInfo]] = {}
    for infos in per_rank:
        for info in infos:
            merged.setdefault(info.op, []).append(info)
    out: list[OperatorInfo] = []
    non_expert_count: dict[int, int] = {}
    for op in sorted(merged):
        holders = merged[op]
        stages = {h.pp_rank for h in holders}
        if len(stages) != 1:
            raise RuntimeError(f"operator {op} is held by several pipeline stages {sorted(stages)}; shared "
                               "embeddings across stages are not supported (use untied embeddings)")
        pp = stages.pop()
        if op.is_expert:
            eps = {h.ep_rank for h in holders}
            if len(eps) != 1:
                raise RuntimeError(f"expert {op} is held by several expert-parallel ranks {sorted(eps)}")
            ep = eps.pop()
        else:
            ep = non_expert_count.get(pp, 0) % max(ep_size, 1)
            non_expert_count[pp] = non_expert_count.get(pp, 0) + 1
        out.append(OperatorInfo(op=op, bytes_compute=max(h.bytes_compute for h in holders),
                                bytes_full=max(h.bytes_full for h in holders), pp_rank=pp, ep_rank=ep))
    return out


def gather_catalogue(local: Sequence[OperatorInfo], ep_size: int, group=None) -> list[OperatorInfo]:
    """All-gather every rank's list (object collective on the host path, ``moe_ft.comm``: ``group`` a host
    group, default the coordination group of all ranks) and merge it."""
    from moe_ft import comm

    return merge_catalogue(comm.all_gather_object(list(local), group), ep_size)
