"""The communication rule (``docs/communication.md``) for CheckFree+ at run time: the partner swap's weight and
gradient trades (``swap_pp.PartnerSwap._trade``) and the embedding / output copies sent to their holder
(``component.CopiesComponent.after_snapshot``) travel on the host path — point-to-point pickles of host
tensors on the coordination gloo group — never on a Megatron (NCCL on a GPU cluster) group.

One torchrun job (4 ranks, PP=4, ``--ft-checkfree-plus``) under ``CollectiveChecker`` (the harness of
``tests/test_comm_rule.py``): training, snapshots, rank 2 SIGKILLed in iteration 3, the restart's recovery
replaying with the swap on; every call our code made must obey the rule, and the CheckFree+ calls must be in
the records.
"""

from __future__ import annotations

import pytest

from tests.test_comm_rule import _check, _launch, _where

EXPECTED = {
    ("send_object_list", "host", "swap_pp.py _trade"),  # swap partners, every iteration
    ("recv_object_list", "host", "swap_pp.py _trade"),
    ("send_object_list", "host", "component.py after_snapshot"),
    ("recv_object_list", "host", "component.py after_snapshot"),  # copies
    ("all_reduce", "host", "agreement.py _min_over_ranks"),  # the restart's recovery (replays swap too)
}


@pytest.mark.multiproc
@pytest.mark.timeout(320)
def test_checkfree_plus_traffic_is_on_the_host_path(tmp_path, corpus):
    records = _launch(tmp_path, corpus, "C", [
        "--pipeline-model-parallel-size", "4", "--num-layers", "4", "--ft-policy", "sparse", "--ft-sparse-window",
        "2", "--ft-checkfree-plus", "--ft-recovery-scope", "global"], ["2:3"])
    _check(records, EXPECTED)
    traders = {r["rank"] for r in records if _where(r["site"]) == "swap_pp.py _trade"}
    holders = {r["rank"] for r in records
               if r["fn"] == "recv_object_list" and _where(r["site"]) == "component.py after_snapshot"}
    assert traders == {0, 1, 2, 3} and holders == {1, 2}
