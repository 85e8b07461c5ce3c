"""``moe-ft inspect``: output and exit codes. Two runs go through ``python -m moe_ft`` as a subprocess (the
way operators call it); the other cases call the same ``main`` in-process to keep the suite fast."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _ft_helpers import damage_blob

from moe_ft.cli.main import main
from moe_ft.state.operators import Level, OperatorId
from moe_ft.store import SnapshotStore, StoreConfig, open_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E0, D0 = OperatorId.expert_op(1, 5), OperatorId.dense(1)


@pytest.fixture
def store_dir(tmp_path):
    store = StoreConfig(root=str(tmp_path), job_id="job", rank=3).build()
    for it in (4, 5):
        with store.begin(it) as point:
            point.put(E0, Level.FULL, {"weight": torch.zeros(64, 32, dtype=torch.bfloat16),
                                       "master.weight": torch.zeros(64, 32)})
            point.put(D0, Level.COMPUTE, {"weight": torch.ones(16, dtype=torch.float16)})
            point.put_meta({"grad_norm": 1.5})
            point.publish()
    return store.backend.directory


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_ft", "inspect", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def flip_byte(store_dir, iteration: int, blob: str, offset: int = 200) -> None:
    store = SnapshotStore(open_backend(store_dir, create=False))
    damage_blob(store, iteration, blob, lambda data: data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1:])


@pytest.mark.timeout(240)
def test_cli_lists_points_and_fails_on_corruption(store_dir):
    assert store_dir.name == "rank3" and store_dir.parent.name == "job"
    healthy = run_cli(store_dir, "--entries")
    assert healthy.returncode == 0, healthy.stderr
    lines = healthy.stdout.splitlines()
    assert "2 published point(s)" in lines[0] and "(arena of " in lines[0]
    assert any(line.split()[:4] == ["4", "1", "1", "yes"] for line in lines)
    assert any("expert.L1.E5" in line and "FULL" in line and "bfloat16[64, 32]" in line for line in lines)

    flip_byte(store_dir, 5, "expert.L1.E5.full.ent")
    broken = run_cli(store_dir, "--verify", "--json")
    assert broken.returncode == 1
    report = json.loads(broken.stdout)
    assert report["verified"] and [p["iteration"] for p in report["points"]] == [4, 5]
    assert report["problems"] == [{"iteration": 5, "what": "expert.L1.E5@FULL",
                                   "reason": report["problems"][0]["reason"]}]
    assert "checksum mismatch" in report["problems"][0]["reason"]
    assert [e["operator"] for e in report["points"][1]["entries"]] == ["dense.L1"]  # the bad one is skipped


def test_checksums_only_with_verify_but_sizes_always(store_dir, capsys):
    flip_byte(store_dir, 4, "dense.L1.compute.ent")
    assert main(["inspect", str(store_dir)]) == 0  # same size: only a checksum can tell
    assert main(["inspect", str(store_dir), "--verify"]) == 1
    assert "CORRUPT: iteration 4 dense.L1@COMPUTE: checksum mismatch" in capsys.readouterr().out
    store = SnapshotStore(open_backend(store_dir, create=False))
    damage_blob(store, 5, "dense.L1.compute.ent", lambda data: data[:100])  # torn: detected by size without reading
    assert main(["inspect", str(store_dir)]) == 1
    assert "CORRUPT: iteration 5 dense.L1@COMPUTE: size 100" in capsys.readouterr().out
    damage_blob(store, 5, "MANIFEST.json", lambda data: b"{")
    assert main(["inspect", str(store_dir), "--json"]) == 1
    problems = json.loads(capsys.readouterr().out)["problems"]
    assert {"iteration": 5, "what": "point"} == {k: problems[-1][k] for k in ("iteration", "what")}


def test_not_a_store_exits_2(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a moe-ft store" in err and "rank0" in err
    assert not any(tmp_path.iterdir())  # inspecting never creates a store
