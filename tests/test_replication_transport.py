"""Transport contract (in-process and gloo) and replication across 2 simulated nodes x 2 ranks."""

import json
import os
import threading

import pytest

from moe_ft.store import StoreConfig
from tests._ft_helpers import torchrun
from tests._workers_replication import contract_receiver, contract_sender

pytestmark = pytest.mark.timeout(120)


def test_contract_in_process(tmp_path):
    from moe_ft.replication import InProcessHub

    hub = InProcessHub()
    store = StoreConfig(root=str(tmp_path / "sender"), job_id="job", rank=0).build()
    errors = []

    def sender():
        try:
            contract_sender(hub.endpoint(0), 1, store)
        except BaseException as exc:  # reported on the test thread
            errors.append(exc)

    thread = threading.Thread(target=sender)
    thread.start()
    contract_receiver(hub.endpoint(1), 0, str(tmp_path / "receiver"))
    thread.join(60)
    assert not thread.is_alive() and not errors, errors


def test_contract_gloo(tmp_path):
    torchrun("tests/_workers_replication.py", ["contract", str(tmp_path)], nproc=2, timeout=100)
    assert sorted(os.listdir(tmp_path / "receiver" / "job" / "replicas")) == ["rank0"]


def test_four_ranks_two_nodes_gloo(tmp_path):
    torchrun("tests/_workers_replication.py", ["nodes", str(tmp_path)], nproc=4, timeout=100)
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(4)]
    assert [r["peer"] for r in results] == [2, 3, 0, 1]  # DP peer on the other node
    assert all(r["rejections"] == 0 and len(r["bytes"]) == 4 for r in results)
