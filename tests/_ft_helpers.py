"""Shared helpers of the moe-ft multi-process tests: a tiny corpus and a torchrun launcher (4 ranks,
1 thread each, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_corpus(directory: str) -> str:
    sys.path.insert(0, ROOT)
    from tools.make_corpus import write_corpus
    from tools.preprocess_data import preprocess

    write_corpus(os.path.join(directory, "c.jsonl"), num_docs=300, seed=0)
    preprocess(os.path.join(directory, "c.jsonl"), os.path.join(directory, "corpus"))
    return os.path.join(directory, "corpus")


def torchrun(script: str, args: list[str], nproc: int = 4, timeout: float = 240, check: bool = True):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.join(ROOT, script), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc
