"""Distributed-optimizer shards in operator entries: range tags, coverage, and re-assembly on another layout.

With Megatron-Core's ``DistributedOptimizer`` each data-parallel rank owns a contiguous range
``[start, end)`` of every parameter's flattened elements (possibly empty): its fp32 master (bf16/fp16
training) and Adam moments are 1-D tensors of ``end - start`` elements. Which range depends on the
data-parallel size and the gradient buffer's layout, so a copy of an operator written on one world does not
fit the shard another world gives the same rank. The operator registry therefore names every sharded
tensor with its range, **tagged**::

    <state key>@<start>:<end>:<numel>.<param name>      e.g. exp_avg@0:4096:16384.decoder.layers.0....weight

(``master``, ``exp_avg``, ``exp_avg_sq``, ``step``; ``numel`` is the whole parameter's). The tag travels in
the manifest with the tensor's name, so every copy of an entry -- a snapshot, a replica, a survivor point --
says which elements it holds, and a node can tell from manifests alone whether the copies it keeps cover a
parameter whole. On the same layout the tagged names match the live ones and restoring is the usual
name-by-name copy; on another layout (an elastic restart changed the data-parallel size, Lazarus §4.3)
:func:`assemble` writes each live shard from the pieces of every copy whose range overlaps it. Lazarus keeps
no ZeRO-sharded state, so this goes past the paper; it stays exact: elements are copied, never recomputed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

_TAG = re.compile(r"^(?P<key>[A-Za-z0-9_]+)@(?P<start>\d+):(?P<end>\d+):(?P<numel>\d+)\.(?P<param>.+)$")


@dataclass(frozen=True)
class ShardTag:
    key: str
    start: int
    end: int
    numel: int
    param: str


def tag(key: str, start: int, end: int, numel: int, param: str) -> str:
    """The tensor name of state ``key`` of the range ``[start, end)`` of ``param`` (``numel`` elements)."""
    return f"{key}@{start}:{end}:{numel}.{param}"


def parse(name: str) -> ShardTag | None:
    """The tag of a sharded tensor's name, or ``None`` for a whole tensor."""
    m = _TAG.match(name)
    if m is None:
        return None
    return ShardTag(m["key"], int(m["start"]), int(m["end"]), int(m["numel"]), m["param"])


def ranges_of(names: Iterable[str]) -> dict[str, tuple[int, int, int]]:
    """``{param: (start, end, numel)}`` of the sharded tensors among ``names`` (one range per parameter:
    a copy holds every state key of a parameter over the same range)."""
    out: dict[str, tuple[int, int, int]] = {}
    for name in names:
        t = parse(name)
        if t is not None:
            out[t.param] = (t.start, t.end, t.numel)
    return out


def uncovered(pieces: Iterable[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """The sub-ranges of ``[start, end)`` that no piece ``(s, e)`` covers."""
    gaps, at = [], start
    for s, e in sorted(pieces):
        if e <= at or s >= end:
            continue
        if s > at:
            gaps.append((at, s))
        at = max(at, e)
        if at >= end:
            break
    if at < end:
        gaps.append((at, end))
    return gaps


def missing_elements(copies: Iterable[Mapping[str, tuple[int, int, int]]],
                     params: Mapping[str, int]) -> dict[str, list[tuple[int, int]]]:
    """``{param: gaps}`` of every parameter of ``params`` (``{param: numel}``, the operator's sharded
    parameters) whose elements the copies' ranges (``ranges_of`` of each copy) do not cover together."""
    out = {}
    for param, numel in params.items():
        gaps = uncovered([(r[param][0], r[param][1]) for r in copies if param in r], 0, numel)
        if gaps:
            out[param] = gaps
    return out


def pick_copies(needed: Mapping[str, tuple[int, int]],
                copies: Iterable[tuple[str, Mapping[str, tuple[int, int, int]]]]) -> list[str]:
    """Keys of copies (``(key, ranges)``, in preference order) that together cover every ``needed``
    ``{param: (start, end)}``: each copy is taken when it adds elements not yet covered; with nothing needed,
    the first copy (the whole tensors -- compute weights -- come from the first copy taken). Raises
    ``ValueError`` naming the first gap when the copies cannot cover."""
    chosen: list[str] = []
    have: dict[str, list[tuple[int, int]]] = {p: [] for p in needed}
    copies = list(copies)
    for key, ranges in copies:
        if _adds(ranges, needed, have):
            chosen.append(key)
            for p in needed:
                if p in ranges:
                    have[p].append(ranges[p][:2])
    if not chosen and copies:
        chosen.append(copies[0][0])
    for p, (s, e) in needed.items():
        gaps = uncovered(have[p], s, e)
        if gaps:
            raise ValueError(f"no copy holds elements {gaps[0][0]}:{gaps[0][1]} of {p}")
    return chosen


def _adds(ranges: Mapping[str, tuple[int, int, int]], needed: Mapping[str, tuple[int, int]],
          have: Mapping[str, list[tuple[int, int]]]) -> bool:
    """Whether a copy with ``ranges`` holds needed elements not yet in ``have``."""
    for p, (s, e) in needed.items():
        if p in ranges:
            lo, hi = max(s, ranges[p][0]), min(e, ranges[p][1])
            if lo < hi and uncovered(have[p], lo, hi):
                return True
    return False


@torch.no_grad()
def assemble(live: Mapping[str, torch.Tensor], sources: list[Mapping[str, torch.Tensor]], *, what: str) -> int:
    """Write every ``live`` tensor from ``sources`` (stored entries, names compared as given): a whole
    tensor from the first source that has it (same shape and dtype); a tagged shard from the overlapping
    pieces of the sources' shards of the same state key and parameter (a 0-dim one, Adam's ``step``, from
    any of them). Raises ``ValueError`` naming ``what`` when an element has no source or shapes disagree;
    returns the bytes written."""
    pieces: dict[tuple[str, str], list[tuple[ShardTag, torch.Tensor]]] = {}
    for entry in sources:
        for name, tensor in entry.items():
            t = parse(name)
            if t is not None:
                pieces.setdefault((t.key, t.param), []).append((t, tensor))
    total = 0
    for name, dst in live.items():
        t = parse(name)
        if t is None:
            src = next((e[name] for e in sources if name in e), None)
            if src is None:
                raise ValueError(f"{what}: no copy holds {name}")
            _check(what, name, src, dst)
            dst.copy_(src)
        elif dst.dim() == 0:
            found = pieces.get((t.key, t.param))
            if not found:
                raise ValueError(f"{what}: no copy holds {t.key} of {t.param}")
            _check(what, name, found[0][1], dst)
            dst.copy_(found[0][1])
        else:
            flat, written = dst.view(-1), []
            for p, tensor in pieces.get((t.key, t.param), []):
                s, e = max(t.start, p.start), min(t.end, p.end)
                if s >= e:
                    continue
                if p.numel != t.numel or tensor.dtype != dst.dtype or tensor.numel() != p.end - p.start:
                    raise ValueError(f"{what}: {name} vs a stored shard {p}: {tensor.dtype}{tuple(tensor.shape)} "
                                     f"does not fit {dst.dtype} of {t.numel} elements")
                flat[s - t.start:e - t.start].copy_(tensor.reshape(-1)[s - p.start:e - p.start])
                written.append((s, e))
            gaps = uncovered(written, t.start, t.end)
            if gaps:
                raise ValueError(f"{what}: no copy holds elements {gaps[0][0]}:{gaps[0][1]} of {t.key} of {t.param}")
        total += dst.nbytes
    return total


def _check(what: str, name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"{what}/{name}: stored {src.dtype}{tuple(src.shape)} vs live {dst.dtype}{tuple(dst.shape)}")
