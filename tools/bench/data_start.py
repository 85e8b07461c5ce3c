"""Start-up cost of the training data on a large corpus: seconds and peak RSS of one rank's ``build_data``.

    python -m tools.bench.data_start [--tokens 200_000_000] [--dir /tmp/data_start] [--json]

Writes (once, kept in ``--dir``) a synthetic indexed dataset of ``--tokens`` uint16 tokens in documents of
500-3500 tokens (a 400 MB ``.bin`` at the default), then runs ``build_data`` for a 4-rank EP job of
``--train-iters`` iterations in a fresh process, three times: without ``--data-cache-path`` (indices built in
memory), with it into an empty cache (``cache_cold``: builds and writes the indices) and with it again
(``cache_warm``: reads the cache the second run wrote). Reports per run: wall seconds of
``build_data`` plus the first iteration's batches, and the process's peak RSS (``ru_maxrss``), with the
process's RSS before building for scale (Megatron-Core and torch imported).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
from megatron.training.arguments import parse_args
from megatron.training.pretrain import build_data
argv = {argv!r}
args = parse_args(argv, world_size=4)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
data = build_data(args)
data.batch_for_iteration(0, 0)
seconds = time.perf_counter() - t0
print(json.dumps({{"seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rss_before_mb": before / 1024, "train_samples": len(data.datasets[0])}}))
"""


def write_corpus(prefix: str, tokens: int, seed: int = 0) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
        return
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    written = 0
    while written < tokens:
        n = min(int(rng.integers(500, 3500)), tokens - written)
        doc = rng.integers(0, 256, n, dtype=np.uint16)
        doc[-1] = 256  # end of document
        builder.add_document(doc, [n])
        written += n
    builder.finalize(prefix + ".idx")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=200_000_000)
    p.add_argument("--dir", default="/tmp/data_start")
    p.add_argument("--train-iters", type=int, default=10_000)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    prefix = os.path.join(a.dir, f"tokens{a.tokens}")
    write_corpus(prefix, a.tokens)
    base = ["--data-path", prefix, "--split", "98,2,0", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "1024", "--num-experts", "4", "--moe-router-topk", "2",
            "--expert-model-parallel-size", "2", "--micro-batch-size", "2", "--global-batch-size", "16",
            "--train-iters", str(a.train_iters)]
    cache = os.path.join(a.dir, "cache")
    rows = {}
    for name, extra in (("in_memory", []), ("cache_cold", ["--data-cache-path", cache]),
                        ("cache_warm", ["--data-cache-path", cache])):
        if name == "cache_cold":
            subprocess.run(["rm", "-rf", cache], check=True)
        out = subprocess.run([sys.executable, "-c", CHILD.format(root=ROOT, argv=base + extra)], check=True,
                             capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
    result = {"bin_mb": os.path.getsize(prefix + ".bin") / 1e6, "tokens": a.tokens, **rows}
    print(json.dumps(result) if a.json else json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
