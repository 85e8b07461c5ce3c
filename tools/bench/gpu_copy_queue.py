"""Does the training thread's small device-to-host read (``.item()``, ``.tolist()``: Megatron's MoE dispatcher
reads its token counts this way in every layer) wait behind a snapshot's large device-to-host copy on the side
stream? Both are device-to-host transfers, which the GPU's copy engines may take in order.

    python -m tools.bench.gpu_copy_queue [--mb 700] [--pieces 1 8 64] [--paced 16 64] [--repeats 20]

For each way of issuing a ``--mb`` MiB snapshot copy into page-locked host memory on a side stream -- one copy,
``--pieces`` copies of equal size queued at once, or paced in pieces of ``--paced`` MiB with a device-side pause
between them (``moe_ft/snapshot/pacing.py``, what ``--ft-snapshot-copy-piece-mb`` does) -- it times ``x.item()``
of a one-element tensor on the compute stream issued right after the snapshot copy, against the same read with
no copy in flight (and the copy's own duration, from CUDA events). Prints one JSON object. Needs CUDA."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _timed_item(x: torch.Tensor) -> float:
    start = time.perf_counter()
    x.item()
    return time.perf_counter() - start


def measure(mb: int, pieces: int, repeats: int, paced_mb: int = 0) -> dict:
    """One row: the copy queued as ``pieces`` copies at once, or (``paced_mb``) paced in pieces of that size."""
    from moe_ft.snapshot.pacing import CopyPacer

    n = mb * 2 ** 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    x = torch.ones(1, device="cuda")
    srcs, dsts = src.chunk(pieces), dst.chunk(pieces)
    pacer = CopyPacer(paced_mb * 2 ** 20) if paced_mb else None
    idle, busy, copy_ms = [], [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        idle.append(_timed_item(x))
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            if pacer is not None:
                pacer.copy([dst], [src])
            else:
                for d, s in zip(dsts, srcs):
                    d.copy_(s, non_blocking=True)
            end.record()
        busy.append(_timed_item(x))
        end.synchronize()
        copy_ms.append(start.elapsed_time(end))
    if pacer is not None:
        pieces = pacer.pieces
    return {"mb": mb, "pieces": pieces, "paced": bool(pacer), "item_ms_idle": 1e3 * statistics.median(idle),
            "item_ms_behind_copy": 1e3 * statistics.median(busy), "copy_ms": statistics.median(copy_ms),
            "copy_gbps": n / statistics.median(copy_ms) / 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=700)
    p.add_argument("--pieces", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--paced", type=int, nargs="*", default=[16, 64], metavar="MB")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_copy_queue needs CUDA", file=sys.stderr)
        return 2
    rows = [measure(a.mb, k, a.repeats) for k in a.pieces] + [measure(a.mb, 1, a.repeats, m) for m in a.paced]
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
