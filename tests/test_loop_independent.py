"""The training loop (``megatron/training``) does not depend on ``moe_ft`` (the entry
script activates the compatibility shims and plugs the runtime into the loop's hooks).

Static: no module under ``megatron/training`` imports ``moe_ft``, at top level or inside a function.
Dynamic (fresh processes): importing every module pulls in no ``moe_ft`` module; a one-rank run saves a
checkpoint and a second run loads it and trains on while every ``moe_ft`` import is refused (only the
compat shims, activated before the loop, are loaded); without the CPU layer the loop stops with the fix.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TRAINING = ROOT / "megatron" / "training"
CHECK = ROOT / "tests" / "_check_loop_independent.py"


def _moe_ft_imports(path: Path) -> list[str]:
    """``moe_ft`` imports in one source file: import statements anywhere, and ``import_module``/
    ``__import__`` calls with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [f"{path}:{node.lineno}: {n}" for n in names
                  if n == "moe_ft" or n.startswith("moe_ft.")]
    return found


def test_static_scan_finds_an_import(tmp_path):
    """The scanner itself: it sees imports inside functions and import_module calls."""
    sample = tmp_path / "sample.py"
    sample.write_text("import moe_ft_other\ndef f():\n    from moe_ft.compat import cpu\n    import importlib\n"
                      "    importlib.import_module('moe_ft.runtime')\n    from moe_ft import runtime\n")
    assert sorted(hit.split(": ")[1] for hit in _moe_ft_imports(sample)) == ["moe_ft", "moe_ft.compat", "moe_ft.runtime"]


def test_no_module_under_megatron_training_imports_moe_ft():
    sources = sorted(TRAINING.rglob("*.py"))
    assert len(sources) >= 9, sources  # the scan found the package
    offenders = [hit for path in sources for hit in _moe_ft_imports(path)]
    assert offenders == [], "megatron/training must not import moe_ft:\n" + "\n".join(offenders)


def _run(*argv: str, timeout: float = 50) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(CHECK), *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])


def test_importing_every_training_module_loads_no_moe_ft():
    out = _run("imports")
    assert "megatron.training.checkpointing" in out["modules"] and "megatron.training.initialize" in out["modules"]
    assert out["moe_ft"] == []


@pytest.mark.timeout(120)  # two one-rank runs in a fresh process (Megatron import, save, load): ~5-20 s
def test_loop_saves_and_loads_with_moe_ft_imports_blocked(corpus, tmp_path):
    out = _run("train", corpus, str(tmp_path), timeout=110)
    assert out["attempts"] == []
    assert out["after"] == out["before"] == ["moe_ft", "moe_ft.compat", "moe_ft.compat.cpu", "moe_ft.compat.writer_queue"]
    assert out["last_iterations"] == [2, 3]  # the second run resumed from the checkpoint of iteration 2


def test_loop_without_cpu_layer_names_the_fix():
    out = _run("unguarded")
    assert out["after"] is None
    if torch.cuda.is_available():
        assert out["before"] is None
    else:
        assert "moe_ft.compat.activate_all()" in out["before"] and "pretrain_gpt_moe.py" in out["before"]
