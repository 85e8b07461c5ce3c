"""``moe-ft digest``: print or compare training-state digests written at the end of training.

``pretrain_gpt_moe.py … --ft --ft-digest-out run.json`` writes ``{"digest", "iteration", "per_rank"}``
(``moe_ft/digest.py``: params, fp32 masters, Adam state and step, LR schedule, RNG of every rank).

    moe-ft digest run.json                 # prints the digest
    moe-ft digest a.json b.json            # exit 0 if bitwise equal, 1 (and the differing ranks) if not
    moe-ft digest DIR                      # every *.json digest file under DIR
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from moe_ft.cli.errors import reporting, user_input
from moe_ft.drills.report import load_digest


def write_digest(path: str, state, iteration: int) -> dict:
    """Collective: every rank's state digest; rank 0 writes the JSON file."""
    import torch.distributed as dist  # start-up time: the moe-ft console script imports this module

    from moe_ft import comm  # start-up time: imports torch and Megatron
    from moe_ft.digest import local_state_tensors, tensor_digest  # start-up time: imports torch

    local = tensor_digest(local_state_tensors(state.model, state.optimizer, state.scheduler))
    per_rank = [local]
    if dist.is_initialized():
        per_rank = comm.all_gather_object(local)
    out = {"digest": hashlib.sha256("".join(per_rank).encode()).hexdigest(), "iteration": iteration,
           "per_rank": per_rank}
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=1)
        os.replace(tmp, path)
    return out


def _files(paths: list[str]) -> list[str]:
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(str(q) for q in Path(p).rglob("*.json"))
            if not found:
                raise ValueError(f"{p}: a directory without *.json digest files; write them with --ft-digest-out")
            out += found
        else:
            out.append(p)
    return out


def run(args) -> int:
    with user_input():
        digests = [(p, load_digest(p)) for p in _files(args.paths)]
    for path, d in digests:
        print(f"{d['digest']}  iteration {d.get('iteration')}  {path}")
    if len(digests) < 2:
        return 0
    ref_path, ref = digests[0]
    equal = True
    for path, d in digests[1:]:
        if d["digest"] != ref["digest"]:
            equal = False
            ranks = [r for r, (a, b) in enumerate(zip(ref.get("per_rank", []), d.get("per_rank", []))) if a != b]
            print(f"DIFFERENT: {path} vs {ref_path} (ranks {ranks})")
    print("EQUAL" if equal else "NOT EQUAL")
    return 0 if equal else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("digest", help="print or compare training-state digests (bitwise)")
    p.add_argument("paths", nargs="+", help="digest JSON files (--ft-digest-out) or directories of them")
    p.set_defaults(func=reporting("digest", run))
