"""Compare two Megatron ``dist_checkpointing`` (torch_dist) checkpoints bitwise, without a process group.

    python tools/compare_checkpoints.py runs/a/iter_0000100 runs/b/iter_0000100

Every sharded tensor and object (model, optimizer state, per-rank RNG) and the common state (scheduler,
iteration) must be equal. Exit code 0 when equal, 1 when not (the differing keys are listed), 2 on bad input.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch


def load_flat(ckpt_dir: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")) and not os.path.isfile(
            os.path.join(ckpt_dir, ".metadata")):
        raise FileNotFoundError(f"{ckpt_dir} is not a torch_dist checkpoint (no .metadata)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "flat.pt")
        dcp_to_torch_save(ckpt_dir, out)
        flat = torch.load(out, weights_only=False)
    common = os.path.join(ckpt_dir, "common.pt")
    if os.path.isfile(common):
        flat["__common__"] = torch.load(common, weights_only=False)
    return flat


def equal(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and \
            torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if hasattr(a, "__array__") and hasattr(b, "__array__"):
        import numpy as np

        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return a == b


def compare(dir_a: str, dir_b: str) -> list[str]:
    a, b = load_flat(dir_a), load_flat(dir_b)
    diffs = sorted(set(a) ^ set(b))
    diffs += [k for k in sorted(set(a) & set(b)) if not equal(a[k], b[k])]
    return diffs


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        diffs = compare(*argv)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if diffs:
        print(f"checkpoints differ in {len(diffs)} entries: {', '.join(diffs[:10])}")
        return 1
    print(f"checkpoints are bitwise equal: {argv[0]} == {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
