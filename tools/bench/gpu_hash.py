"""The ``mfh64`` entry checksum on CUDA: the Triton kernel against the snapshot's own device-to-host copy,
side by side in one run.

    python -m tools.bench.gpu_hash [--mib 64 1024] [--iters 20]

For each buffer size (bf16, on the device) prints, in one JSON object:

* ``hash_gbps``: the kernel (``entry_hash_triton.device_digest``) over the buffer, bytes / device time
  (CUDA events), median over ``--iters``;
* ``d2h_gbps``: one ``copy_(non_blocking=True)`` of the same buffer into pinned host memory;
* ``hash_vs_d2h``: the hash's device time over the copy's: what hashing on the device adds to a snapshot
  whose copy is the bound (the kernel reads HBM, which the copy barely loads);
* ``copy_with_hash_ratio``: the copy's time while the kernel hashes another buffer on a second stream
  throughout, over the copy alone (1.0: the hash does not slow the copy; meaningful where the copy lasts
  much longer than a kernel launch, i.e. the larger rows);
* ``host_ref_gbps`` / ``host_xxh3_gbps``: the PyTorch reference and XXH3-64 on the host copy (what a host
  verification costs, one core);
* ``matches_reference``: the kernel's digest equals the host reference's, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import xxhash

from moe_ft.store import entry_hash as eh
from moe_ft.store import entry_hash_triton as et


def _timed(fn, iters: int, stream=None) -> float:
    """Median device seconds of ``fn()`` on ``stream`` (CUDA events)."""
    stream = stream or torch.cuda.current_stream()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            fn()
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_beside_hashes(buf, other, host, hashes: int, iters: int) -> float:
    """Median device seconds of the copy of ``buf`` into ``host`` on one stream while another stream hashes
    ``other`` ``hashes`` times, starting with the copy (queued right after it: with a copy much longer than
    a kernel launch, the hashes cover it)."""
    copy_stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(copy_stream):
            start.record()
            host.copy_(buf, non_blocking=True)
            end.record()
        side.wait_event(start)
        with torch.cuda.stream(side):
            for _ in range(hashes):
                et.device_digest(other)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def _host_gbps(fn, nbytes: int) -> float:
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e9


def measure(mib: int, iters: int) -> dict:
    n = mib << 20
    gen = torch.Generator(device="cuda").manual_seed(0)
    buf = torch.randn(n // 2, generator=gen, device="cuda").to(torch.bfloat16)
    other = torch.randn(n // 2, generator=gen, device="cuda").to(torch.bfloat16)
    host = torch.empty(n // 2, dtype=torch.bfloat16, pin_memory=True)
    for _ in range(3):  # compile and warm up
        et.device_digest(buf)
        host.copy_(buf, non_blocking=True)
    torch.cuda.synchronize()
    t_hash = _timed(lambda: et.device_digest(buf), iters)
    t_copy = _timed(lambda: host.copy_(buf, non_blocking=True), iters)
    t_both = _copy_beside_hashes(buf, other, host, round(t_copy / max(t_hash, 1e-9)) + 1, iters)
    torch.cuda.synchronize()
    digest = et.finish(et.device_digest(buf))
    host.copy_(buf)
    row = {"mib": mib, "hash_gbps": n / t_hash / 1e9, "d2h_gbps": n / t_copy / 1e9,
           "hash_vs_d2h": t_hash / t_copy, "copy_with_hash_ratio": t_both / t_copy}
    if mib <= 1024:
        ref: list[bytes] = []
        row["host_ref_gbps"] = _host_gbps(lambda: ref.append(eh.reference_digest(host)), n)
        view = eh.byte_view(host).numpy().data
        row["host_xxh3_gbps"] = _host_gbps(lambda: xxhash.xxh3_64(view).digest(), n)
        row["matches_reference"] = ref[0] == digest
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tools.bench.gpu_hash needs a CUDA device")
    out = {"device": torch.cuda.get_device_name(), "rows": [measure(m, args.iters) for m in args.mib]}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
