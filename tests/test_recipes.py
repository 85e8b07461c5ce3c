"""The GPU recipes (examples/h200_bf16.sh, examples/h100_fp8.sh) as a user runs them, checked on CPU.

Each recipe prints its command with ``DRY_RUN=1``. At full scale (4 nodes of 8 GPUs) the launcher's flags and
the training flags parse and validate as they are (Transformer Engine stands in as an empty module: only its
import is checked at parse time). Then each recipe runs on CPU with 4 ranks at reduced size: the same plan
(EP inside a node, PP over nodes: 2 simulated nodes of 2 ranks), its data, tokenizer and fault-tolerance
flags, Megatron-Core's local layers instead of TE (and moe-ft's FP8 emulation for the FP8 recipe).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.validation import TE_NONDETERMINISTIC_ENV  # noqa: E402
from moe_ft.store import entry_hash  # noqa: E402
from pretrain_gpt_moe import extra_argument_groups  # noqa: E402
from tests._ft_helpers import free_port, wait_until  # noqa: E402
from tools.preprocess_data import preprocess  # noqa: E402

RECIPES = ("h200_bf16", "h100_fp8")

SCALED_DOWN = {"--num-layers": "2", "--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "128",
               "--seq-length": "64", "--max-position-embeddings": "64", "--num-experts": "8",
               "--moe-router-topk": "2", "--global-batch-size": "8", "--micro-batch-size": "2",
               "--train-iters": "6", "--lr-warmup-iters": "1", "--eval-interval": "0", "--num-threads": "1",
               "--log-interval": "1", "--lr": "3e-3", "--min-lr": "3e-4"}
"""Sizes for 2 CPU cores; the parallel plan, data, tokenizer and fault-tolerance flags stay the recipe's."""


@pytest.fixture(scope="module")
def gpt2_data(bpe, tmp_path_factory):
    """Two GPT-2-BPE indexed datasets (blended by the recipes' ``DATA``) and the tokenizer's files."""
    corpus, vocab, merges, _ = bpe
    d = tmp_path_factory.mktemp("recipe_data")
    prefixes = [str(d / name) for name in ("web", "code")]
    for prefix in prefixes:
        preprocess(corpus, prefix, tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges,
                   append_eod=True)
    return {"DATA": f"0.7 {prefixes[0]} 0.3 {prefixes[1]}", "VOCAB": vocab, "MERGES": merges}


def dry_run(recipe: str, **env: str) -> tuple[list[str], list[str]]:
    """The recipe's command: (launcher and its flags, training flags)."""
    out = subprocess.run(["bash", f"examples/{recipe}.sh"], env={**os.environ, "DRY_RUN": "1", **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.splitlines()
    cut = cmd.index("pretrain_gpt_moe.py")
    return cmd[:cut], cmd[cut + 1:]


def test_a_recipe_without_its_inputs_names_them(gpt2_data):
    out = subprocess.run(["bash", "examples/h200_bf16.sh"], env={**os.environ, "DRY_RUN": "1"}, cwd=ROOT,
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "set DATA to an indexed dataset prefix" in out.stderr
    out = subprocess.run(["bash", "examples/h200_bf16.sh"], env={**os.environ, "DRY_RUN": "1", "DATA": "x"},
                         cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "set VOCAB to the GPT-2 vocab.json" in out.stderr


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_parses_at_full_scale(recipe, gpt2_data, tmp_path, monkeypatch):
    from moe_ft.launch.cli import parse_args as launch_args

    launcher, flags = dry_run(recipe, NNODES="4", NODE_RANK="2", MASTER_ADDR="node0", SAVE=str(tmp_path),
                              **gpt2_data)
    assert launcher[:2] == ["moe-ft", "launch"]
    launch = launch_args([*launcher[2:], "pretrain_gpt_moe.py"])
    assert (launch.nnodes, launch.node_rank, launch.nproc_per_node, launch.spares_per_node) == ("4", 2, "8", 0)
    assert launch.rdzv_endpoint == "node0:29500" and launch.rdzv_backend == "c10d"

    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.delenv(TE_NONDETERMINISTIC_ENV, raising=False)
    args = parse_args(flags, world_size=32, extra_groups=extra_argument_groups())
    m, p, d = args.model, args.parallel, args.data
    assert m.transformer_impl == "transformer_engine" and m.bf16
    assert (p.expert_model_parallel_size, p.pipeline_model_parallel_size, args.data_parallel_size) == (8, 4, 8)
    assert d.tokenizer_type == "GPT2BPETokenizer" and d.vocab_file == gpt2_data["VOCAB"]
    assert d.data_path == gpt2_data["DATA"].split() and d.data_cache_path == f"{tmp_path}/data_cache"
    ft = args.extra["FTConfig"]
    assert ft.ft and ft.snapshot.policy == "sparse" and ft.replication.replicas == 1
    assert ft.persist.interval == 100 and ft.persist.agent and args.training.deterministic
    assert (m.fp8_format, m.fp8_recipe) == (("hybrid", "delayed") if recipe == "h100_fp8" else (None, "delayed"))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_trains_on_cpu_at_reduced_size(recipe, gpt2_data, tmp_path):
    """4 ranks (EP=2 inside each of 2 simulated nodes, PP=2 over them), the recipe's flags otherwise:
    bf16, blended GPT-2-BPE data, sparse snapshots, a replica on the other node, a durable copy every 2
    iterations, Megatron checkpoint at the end. The FP8 recipe runs moe-ft's FP8 emulation, which keeps whole
    fp32 masters (no distributed optimizer)."""
    extra = "--ft-ranks-per-node 2" + (" --fp8-emulation" if recipe == "h100_fp8" else "")
    launcher, flags = dry_run(recipe, NPROC="4", EP="2", PP="2", IMPL="local", MASTER_PORT=str(free_port()),
                              SAVE=str(tmp_path / "save"), STORE=str(tmp_path / "store"), PERSIST="2",
                              EXTRA=extra, **gpt2_data)
    for i, flag in enumerate(flags):
        if flag in SCALED_DOWN:
            flags[i + 1] = SCALED_DOWN[flag]
    if recipe == "h100_fp8":
        flags.remove("--use-distributed-optimizer")
    assert launcher[:2] == ["moe-ft", "launch"]
    cmd = [sys.executable, "-m", "moe_ft", "launch", "--preload", *launcher[2:], "pretrain_gpt_moe.py", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    losses = [float(x) for x in re.findall(r"iteration +\d+/6 \| loss ([0-9.a-z+-]+)", out)]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses), out[-3000:]
    assert "world 4 | PP 2 | VP 1 | EP 2 | DP 2" in out
    assert (tmp_path / "save" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert any((tmp_path / "save" / "ft").rglob("complete/*.json")), "no complete durable point written"
    # one pass per byte: the copy into the arena hashes (moe-ft's C extension); without it, checksum + write
    passes = 1 if entry_hash.NATIVE else 2
    assert re.search(rf"\| trainer {passes}\.\d\d B/B, [0-9.]+ ms CPU \|", out), out[-3000:]
    assert re.search(r"\| agent [0-9.]+ ms CPU/it \|", out), out[-3000:]  # the agent's CPU, apart
    (agent_log,) = (tmp_path / "store").rglob("agent.log")  # the node agent wrote it, then left
    wait_until(lambda: "exiting (every rank said bye)" in agent_log.read_text(), timeout=30, message=agent_log.read_text())
    assert "not installed" not in out, "expected warnings must be held back (one summary line)"
    print(f"{recipe} on CPU at reduced size: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
