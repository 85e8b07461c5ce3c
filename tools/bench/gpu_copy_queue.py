"""Does the training thread's small device-to-host read (``.item()``, ``.tolist()``: Megatron's MoE dispatcher
reads its token counts this way in every layer) wait behind a snapshot's large device-to-host copy on the side
stream? Both are device-to-host transfers, which the GPU's copy engines may take in order.

    python -m tools.bench.gpu_copy_queue [--mb 700] [--pieces 1 8 64] [--paced 16 64] [--kernel 8 16 32 0]
                                         [--repeats 20]

For each way of issuing a ``--mb`` MiB snapshot copy into page-locked host memory on a side stream -- one copy,
``--pieces`` copies of equal size queued at once, paced in pieces of ``--paced`` MiB with a device-side pause
between them (``moe_ft/snapshot/pacing.py``, what ``--ft-snapshot-copy-piece-mb`` does), or by the hash kernel
on ``--kernel`` programs (0: one per block), which stores the words it hashes through the device's mapping of the
host memory (``--ft-snapshot-copy-by kernel``, ``moe_ft/snapshot/mapped.py``) -- it times ``x.item()`` of a
one-element tensor on the compute stream issued right after the snapshot copy, and ``(x + 1).item()`` (a small
kernel, which needs a free SM, then the read), against the same with no copy in flight (and the copy's own
duration, from CUDA events). Every row's copy is checked byte for byte once. Prints one JSON object. Needs
CUDA."""

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


def _timed_kernel_item(x: torch.Tensor) -> float:
    start = time.perf_counter()
    (x + 1).item()
    return time.perf_counter() - start


def measure(mb: int, pieces: int, repeats: int, paced_mb: int = 0, kernel_programs: int | None = None) -> dict:
    """One row: the copy queued as ``pieces`` copies at once, (``paced_mb``) paced in pieces of that size, or
    (``kernel_programs``) by the hash kernel on that many programs."""
    from moe_ft.snapshot.mapped import _mapped_device_pointer
    from moe_ft.snapshot.pacing import CopyPacer
    from moe_ft.store.entry_hash_triton import TensorTable

    n = mb * 2 ** 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    x = torch.ones(1, device="cuda")
    srcs, dsts = src.chunk(pieces), dst.chunk(pieces)
    pacer = CopyPacer(paced_mb * 2 ** 20) if paced_mb else None
    table = addr = None
    if kernel_programs is not None:
        table = TensorTable([src], [0])
        addr = torch.tensor([_mapped_device_pointer(dst.data_ptr())], dtype=torch.int64, device="cuda")

    def copy() -> None:
        if table is not None:
            table.launch(addr, programs=kernel_programs or 0)
        elif pacer is not None:
            pacer.copy([dst], [src])
        else:
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)

    dst.zero_()
    with torch.cuda.stream(side):
        copy()
    torch.cuda.synchronize()
    if not torch.equal(dst.cuda(), src):
        raise SystemExit(f"gpu_copy_queue: the copy ({pieces=}, {paced_mb=}, {kernel_programs=}) lost bytes")
    idle: list[float] = []
    busy: list[float] = []
    kidle: list[float] = []
    kbusy: list[float] = []
    copy_ms: list[float] = []
    for probe, at_idle, behind in ((_timed_item, idle, busy), (_timed_kernel_item, kidle, kbusy)):
        for _ in range(repeats):
            torch.cuda.synchronize()
            at_idle.append(probe(x))
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(side):
                start.record()
                copy()
                end.record()
            behind.append(probe(x))
            end.synchronize()
            copy_ms.append(start.elapsed_time(end))
    if pacer is not None:
        pieces = pacer.pieces
    return {"mb": mb, "pieces": pieces, "paced": bool(pacer), "kernel_programs": kernel_programs,
            "item_ms_idle": 1e3 * statistics.median(idle), "item_ms_behind_copy": 1e3 * statistics.median(busy),
            "kernel_item_ms_idle": 1e3 * statistics.median(kidle),
            "kernel_item_ms_behind_copy": 1e3 * statistics.median(kbusy), "copy_ms": statistics.median(copy_ms),
            "copy_gbps": n / statistics.median(copy_ms) / 1e6}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=700)
    p.add_argument("--pieces", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--paced", type=int, nargs="*", default=[16, 64], metavar="MB")
    p.add_argument("--kernel", type=int, nargs="*", default=[8, 16, 32, 0], metavar="PROGRAMS",
                   help="rows copied by the hash kernel on this many programs (0: one per block)")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    if any(k < 0 for k in a.kernel):
        p.error("--kernel takes program counts >= 0")
    if not torch.cuda.is_available():
        print("gpu_copy_queue needs CUDA", file=sys.stderr)
        return 2
    rows = ([measure(a.mb, k, a.repeats) for k in a.pieces] + [measure(a.mb, 1, a.repeats, m) for m in a.paced]
            + [measure(a.mb, 1, a.repeats, kernel_programs=k) for k in a.kernel])
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
