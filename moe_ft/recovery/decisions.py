"""The failed decisions of a recovery (``ledger.py``) as every rank uses them: the union all ranks avoid, the
report's line about them, and the recording of a decision whose own error ends the attempt."""

from __future__ import annotations

from typing import Any, Callable

from moe_ft import comm
from moe_ft.launch.worker import peer_failure
from moe_ft.recovery.ledger import Avoided, DecisionLedger
from moe_ft.recovery.report import RecoveryReport


def agreed_avoided(ledger: DecisionLedger) -> Avoided:
    """The decisions any rank recorded as failed (collective): every rank avoids the same ones."""
    avoided = Avoided()
    for data in comm.all_gather_object(ledger.load().to_json()):
        avoided = avoided.merge(Avoided.from_json(data))
    return avoided


def note_avoided(report: RecoveryReport, avoided: Avoided) -> None:
    """Say in the report which failed decisions this recovery did not repeat."""
    if not avoided:
        return
    report.scope["avoided"] = avoided.to_json()
    parts = [f"localized recovery to iteration {t} ({why})" for t, why in sorted(avoided.localized.items())]
    parts += [f"restoring point {p} ({why})" for p, why in sorted(avoided.global_points.items())]
    report.message = (f"{report.message}; " if report.message else "") + (
        "not repeated, it failed before: " + "; ".join(parts))


def recording(ledger: DecisionLedger | None, scope: str, iteration: Callable[[], int | None], run: Callable[[], Any]):
    """``run()``; when it raises an error of its own (not a failed collective: a peer died), record the
    decision (``scope``, ``iteration()``) as failed before the error ends the attempt."""
    try:
        return run()
    except Exception as e:
        at = iteration()
        if ledger is not None and at is not None and not peer_failure(e):
            ledger.record(scope, at, f"{type(e).__name__}: {e}")
        raise
