"""What an elastic drill (``moe-ft drill --nodes N --elastic``) reports beside the digests.

An elastic run is not bitwise equal to the fault-free run: after a world change the same global batch is
split into other micro-batches on other ranks and its gradients are summed in another order, and Adam
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
import re
from pathlib import Path

import torch

from moe_ft.state.naming import global_expert_indices

_LOSS = re.compile(r"^iteration\s+(\d+)/\s*\d+ \| loss ([0-9.eE+-]+)")
_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(.*)$")


def dump_parameters(path: str, model_chunks) -> None:
    """Every parameter of this rank, experts renamed ``...mlp.experts.E<global id>.<param>``."""

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
            out[name] = param.detach().float().cpu().clone()
    torch.save(out, path)


def load_parameters(paths: list[str]) -> dict[str, torch.Tensor]:
    """Union of the ranks' dumps; copies of one name (data-parallel replicas, expert holders) must agree."""
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
    ref_paths = sorted(str(p) for p in Path(reference_dump).parent.glob(Path(reference_dump).name + ".params_rank*.pt"))
    bad_paths = sorted(str(p) for p in Path(faulty_dump).parent.glob(Path(faulty_dump).name + ".params_rank*.pt"))
    if ref_paths and bad_paths:
        out.update(param_deviation(load_parameters(ref_paths), load_parameters(bad_paths)))
    return out
