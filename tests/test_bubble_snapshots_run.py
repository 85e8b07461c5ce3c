"""``--ft-snapshot-bubble-aware`` in a real run (MoEtion §5.3 Alg. 4): EP=2 x PP=2 under torchrun.

The schedule trace (``--ft-trace-out``: ``<trace>.bubbles.rank<r>.jsonl``) shows where the copies landed:
every piece copied as ``W_bubble`` started while its stage was idle in a pipeline exchange of the 1F1B
schedule (the online bubble profiler's intervals), and such pieces exist on every rank once the copy
bandwidth is measured. The schedule moves bytes in time only: the final training state is bitwise that of
the fault-free run without the flag (the session's ``fault_free_digest``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_ft.cli.drill import run_job

pytestmark = pytest.mark.multiproc

ITERS = 10  # the session's fault-free EP=2 x PP=2 reference (shared with the drills)


def _run(corpus: str, work: Path, job: str, extra: list[str]) -> dict:
    res = run_job(job=job, workdir=str(work), layout="ep2pp2", policy="sparse", iters=ITERS, data=corpus,
                  store=str(work / "store"), window=2, extra=extra, timeout=300)
    assert res["rc"] == 0 and res["digest"], f"{job} failed (rc {res['rc']}), see {res['log']}"
    return res


@pytest.mark.timeout(600)
def test_bubble_aware_copies_land_in_bubbles_and_change_nothing(corpus, tmp_path, fault_free_digest):
    trace = tmp_path / "trace.jsonl"
    aware = _run(corpus, tmp_path, "aware", ["--ft-snapshot-bubble-aware", "--ft-trace-out", str(trace),
                                             "--ft-log-interval", "1"])
    assert aware["digest"] == fault_free_digest("ep2pp2", ITERS)  # the same run without bubble-aware copies
    for rank in range(4):
        lines = [json.loads(x) for x in Path(f"{trace}.bubbles.rank{rank}.jsonl").read_text().splitlines()]
        assert [x["iteration"] for x in lines] == list(range(ITERS))
        idle = [tuple(i) for x in lines for i in x["idle"]]
        pieces = [p for x in lines for p in x["pieces"]]
        assert idle and all(end >= start for start, end in idle)
        in_bubbles = [p for p in pieces if p["kind"] == "bubble"]
        assert in_bubbles, (rank, pieces[:4])
        for piece in in_bubbles:
            assert any(start <= piece["start"] <= end for start, end in idle), (rank, piece)
        assert {p["kind"] for p in pieces} <= {"compute", "bubble", "forced"}
    assert "bubbles " in Path(aware["log"]).read_text()
