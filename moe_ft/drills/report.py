"""What a drill reads back from its runs, and what an elastic drill reports beside the digests.

Every drill: the final training-state digest of a run (:func:`read_digest`, :func:`load_digest`), the
recovery reports it wrote (:func:`read_reports`) and the newest iteration its ranks completed
(:func:`last_completed`). This module imports no torch at module level: the ``moe-ft`` console script
imports it for these readers and must start fast.

An elastic drill (``moe-ft drill --nodes N --elastic``) is not bitwise equal to the fault-free run: after
a world change the same global batch is split into other micro-batches on other ranks and its gradients are summed in another order, and Adam
carries the float round-off forward. So the drill compares

* the loss curves (rank 0's ``iteration N/M | loss X`` lines; a re-executed iteration's last line wins):
  ``max_abs_loss_diff`` over the iterations both runs trained;
* the final parameters (:func:`dump_parameters` at the end of both runs, experts named by their *global*
  id so that any replica plan compares with any other): ``max_abs_param_diff`` and where it is largest;
* the elastic reports (``elastic_<generation>.json``): which point each world change restored, the
  iterations trained again, experts fetched.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from moe_ft.recovery.progress import read_progress

if TYPE_CHECKING:  # annotations only; see the module docstring
    import torch

_LOSS = re.compile(r"^iteration\s+(\d+)/\s*\d+ \| loss ([0-9.eE+-]+)")
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(.*)$")


def load_digest(path: str) -> dict:
    """The digest file ``--ft-digest-out`` wrote (``{"digest", "iteration", "per_rank"}``), checked:
    ``ValueError`` saying what to do when it is missing or not a digest file."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file or directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a digest file ({e}); write one with --ft-digest-out") from None
    if not isinstance(data, dict) or not isinstance(data.get("digest"), str):
        raise ValueError(f"{path}: no 'digest' field; write one with --ft-digest-out")
    per_rank = data.get("per_rank", [])
    if not isinstance(per_rank, list) or not all(isinstance(d, str) for d in per_rank):
        raise ValueError(f"{path}: 'per_rank' is not a list of digests (one string per rank); write the file "
                         "again with --ft-digest-out")
    return data


def read_digest(path: str) -> str | None:
    """The digest a run wrote to ``path``; ``None`` if it wrote none (it failed before the end)."""
    return load_digest(path)["digest"] if os.path.exists(path) else None


def read_reports(where: str | Path | Iterable[str | Path], job: str | None = None) -> list[dict]:
    """The recovery reports (``recovery_<restart>.json``, one per restart), in order. ``read_reports(store,
    job)``: one job's, in ``<store>/<job>/reports`` (where the runtime writes them unless
    ``--ft-report-dir`` is given); ``read_reports(report_dirs)``: those directories' in turn (a simulated
    cluster's agent launches, each with its own ``--ft-report-dir``)."""
    if job is not None:
        dirs = [Path(where) / job / "reports"]  # type: ignore[arg-type]
    elif isinstance(where, (str, Path)):
        raise TypeError("read_reports(store, job) or read_reports([report_dir, ...]): a store needs its job")
    else:
        dirs = [Path(d) for d in where]
    out = []
    for d in dirs:
        out += [json.loads(p.read_text()) for p in sorted(d.glob("recovery_*.json"))]
    return out


def last_completed(stores: Iterable[Path]) -> int:
    """The newest iteration any rank of these node stores completed (``<store>/<job>/progress_rank<r>``;
    -1: none). Read before a lost node's store is deleted: with every node lost, nothing else remembers it.
    (The runtime's own reading, collective and per rank, is ``moe_ft.recovery.progress.last_completed``.)"""
    files = [p for s in stores for p in s.glob("*/progress_rank*") if not p.suffix]  # not a .tmp being written
    done = [r for r in map(read_progress, files) if r is not None]  # records the running ranks rewrite
    return max(done, default=-1)


def dump_parameters(path: str, model_chunks) -> None:
    """Every parameter of this rank, layers by their global index (pipeline stages number their layers from
    0) and experts renamed ``...mlp.experts.E<global id>.<param>``."""
    import torch  # start-up time: the moe-ft console script imports this module for its readers

    from moe_ft.state.naming import global_expert_indices  # start-up time: imports torch

    out = {}
    for chunk in model_chunks:
        gpt = getattr(chunk, "module", chunk)
        for name, param in gpt.named_parameters():
            m = _EXPERT.match(name)
            if m is not None:
                layer = gpt.decoder.layers[int(name.split(".")[2])]
                expert = global_expert_indices(layer.mlp)[int(m.group(2))]
                if expert < 0:  # a spare slot (in-run rebalancing): no expert's parameters
                    continue
                name = f"{m.group(1)}E{expert}.{m.group(3)}"
            if name.startswith("decoder.layers."):
                local, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{gpt.decoder.layers[int(local)].layer_number - 1}.{rest}"
            out[name] = param.detach().float().cpu().clone()
    torch.save(out, path)


def load_parameters(paths: list[str]) -> dict[str, torch.Tensor]:
    """Union of the ranks' dumps; copies of one name (data-parallel replicas, expert holders) must agree."""
    import torch  # start-up time: the moe-ft console script imports this module for its readers

    merged: dict[str, torch.Tensor] = {}
    for path in paths:
        for name, value in torch.load(path).items():
            if name in merged and not torch.equal(merged[name], value):
                raise AssertionError(f"{path}: copies of {name} differ between ranks")
            merged[name] = value
    return merged


def param_deviation(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> dict:
    if set(reference) != set(other):
        missing = sorted(set(reference) ^ set(other))
        raise AssertionError(f"the runs have different parameters: {missing[:4]}")
    worst, name_of_worst = 0.0, ""
    for name, ref in reference.items():
        diff = float((ref - other[name]).abs().max()) if ref.numel() else 0.0
        if diff > worst:
            worst, name_of_worst = diff, name
    scale = max(float(t.abs().max()) for t in reference.values() if t.numel())
    return {"max_abs_param_diff": worst, "worst_param": name_of_worst, "max_abs_param": scale}


def losses_from_logs(paths: list[str]) -> dict[int, float]:
    """``{iteration (1-based): loss}`` from rank 0's log lines, in file order (last line of an iteration wins)."""
    out: dict[int, float] = {}
    for path in paths:
        if not Path(path).exists():
            continue
        for line in Path(path).read_text(errors="replace").splitlines():
            m = _LOSS.match(line)
            if m:
                out[int(m.group(1))] = float(m.group(2))
    return out


def elastic_reports(report_dirs: list[str]) -> list[dict]:
    out = []
    for d in report_dirs:
        out += [json.loads(p.read_text()) for p in sorted(Path(d).glob("elastic_*.json"))]
    return sorted(out, key=lambda r: r["generation"])


def _final_dumps(dump: str) -> list[str]:
    """The parameter dumps of the ranks of the run's final world (the digest file lists one digest per rank;
    a rank that left the world earlier, e.g. one standing by as a spare, may have left a dump of its own)."""
    path = Path(dump)
    world = len(json.loads(path.read_text()).get("per_rank", [])) if path.exists() else None
    out = []
    for p in sorted(path.parent.glob(path.name + ".params_rank*.pt")):
        rank = int(p.name.rsplit("params_rank", 1)[1].removesuffix(".pt"))
        if world is None or rank < world:
            out.append(str(p))
    return out


def summary(*, reference_log: str, faulty_logs: list[str], reference_dump: str, faulty_dump: str,
            report_dirs: list[str]) -> dict:
    """The drill's ``elastic`` section (see the module docstring)."""
    ref_losses, bad_losses = losses_from_logs([reference_log]), losses_from_logs(faulty_logs)
    common = sorted(set(ref_losses) & set(bad_losses))
    out = {"losses_faultfree": [ref_losses[i] for i in sorted(ref_losses)],
           "losses_elastic": [bad_losses[i] for i in sorted(bad_losses)],
           "iterations_compared": len(common),
           "max_abs_loss_diff": max((abs(ref_losses[i] - bad_losses[i]) for i in common), default=None),
           "reports": elastic_reports(report_dirs)}
    ref_paths, bad_paths = _final_dumps(reference_dump), _final_dumps(faulty_dump)
    if ref_paths and bad_paths:
        out.update(param_deviation(load_parameters(ref_paths), load_parameters(bad_paths)))
    return out
