"""The ``published:corrupt`` fault: validation and the damage it does to a published point."""

from __future__ import annotations

import pytest

from moe_ft.drills.faults import Fault, corrupt_point
from moe_ft.store import LocalFSBackend


@pytest.mark.timeout(30)
def test_corrupt_goes_with_published_only():
    assert str(Fault.parse("2:6:published:corrupt")) == "2:6:published:corrupt"
    for bad in ("2:6:publish:corrupt", "2:6:published", "2:6:published:exit"):
        with pytest.raises(ValueError, match="published"):
            Fault.parse(bad)


@pytest.mark.timeout(30)
def test_corrupt_point_flips_one_byte_of_a_full_entry(tmp_path):
    files = {"MANIFEST.json": b"{}" * 8, "_meta.ent": bytes(64), "a.compute.ent": bytes(64),
             "b.full.ent": bytes(range(64)), "c.full.ent": bytes(64)}
    backend = LocalFSBackend(tmp_path / "store")
    point = backend.begin_point(3)
    for name, data in files.items():
        if name != "MANIFEST.json":
            sink = point.open_blob(name)
            sink.write(data)
            sink.close()
    point.commit(files["MANIFEST.json"])
    damaged = corrupt_point((backend, 3))
    assert damaged.endswith("iteration 3 b.full.ent")
    after = {name: backend.read_blob(3, name) for name in files}
    diff = [i for i, (x, y) in enumerate(zip(files["b.full.ent"], after["b.full.ent"])) if x != y]
    assert diff == [32] and after["b.full.ent"][32] == 32 ^ 0xFF
    assert all(after[n] == files[n] for n in files if n != "b.full.ent")
    with pytest.raises(ValueError, match="published point"):
        corrupt_point(None)
