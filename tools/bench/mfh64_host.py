"""Host bandwidth of the store's checksums on one core: the ``mfh64`` NumPy reference, its C build (hash
alone, and the copy that hashes: the CPU snapshot path's one pass into the arena), a plain copy and XXH3, on
the same buffer, side by side in one run (docs/store.md, "A copy that hashes").

    python -m tools.bench.mfh64_host [--mb 256] [--repeats 5]

Prints one JSON object: GB/s per path (best of ``--repeats``; the NumPy reference on a quarter of the buffer,
it is ~10x slower), and ``native``: whether the C build is installed (without it only the other paths run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=256, help="buffer size in MiB (beyond the caches: a pass over memory)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.mb < 1 or a.repeats < 1:
        p.error("--mb and --repeats must be >= 1")
    import numpy as np
    import torch
    import xxhash

    from moe_ft.store import entry_hash

    torch.set_num_threads(1)
    nbytes = a.mb << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.ones_like(src)  # its pages touched before any measurement
    words = src.numpy().view(np.uint32)

    def gbps(fn, n=nbytes) -> float:
        best = min(_timed(fn) for _ in range(a.repeats))
        return round(n / best / 1e9, 2)

    out = {"mb": a.mb, "native": entry_hash.NATIVE,
           "memcpy_gbps": gbps(lambda: dst.copy_(src)),
           "xxh3_64_gbps": gbps(lambda: xxhash.xxh3_64(src.numpy()).digest()),
           "mfh64_numpy_gbps": gbps(lambda: entry_hash._lane_sums_numpy(words[:words.size // 4], 0), nbytes // 4)}
    if entry_hash.NATIVE:
        out["mfh64_c_gbps"] = gbps(lambda: entry_hash._lane_sums_host(words, 0))
        out["copy_mfh64_c_gbps"] = gbps(lambda: entry_hash.copy_lane_sums(src, dst, 0))
    print(json.dumps(out))
    return 0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
