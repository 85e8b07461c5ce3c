"""Recovery decisions that failed, so that the next recovery does not repeat them unchanged.

A recovery can fail for a reason of its own that would recur on every try: a replay that diverges (the
routing check), an entry that does not fit the model, a restore that raises. Retried unchanged, the same
decision fails again, the launcher starts the next attempt, and the job loops until ``--max-restarts``
runs out (``moe-ft launch`` counts every in-process replacement, wait and shrink against it too). So a rank whose recovery raises
such an error records the decision here before the error ends the attempt, and the next recovery changes it
(every rank agrees on the union of the records):

* a localized recovery to target ``T`` that failed → the global scope;
* a global recovery of point ``P`` that failed → the newest point older than ``P`` (bounded from above by
  ``P - 1``; no older point: the durable tier, ``--load`` or the start);

and the report says which decisions it avoided and why. A failed collective (a peer died during the
recovery) is not the decision's fault and is not recorded: the next recovery may take the same decision.
A recovery that completes clears the record.

One JSON file per rank in the job's directory of the node-local store (a lost node loses its records with
its store; the survivors' are enough to change the decision).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field

LOCALIZED, GLOBAL = "localized", "global"


@dataclass
class Avoided:
    """The decisions the next recovery must not repeat (the union over ranks)."""

    localized: dict[int, str] = field(default_factory=dict)
    """Localized target → why it failed."""
    global_points: dict[int, str] = field(default_factory=dict)
    """Restored iteration of a global recovery → why it failed."""

    @property
    def below(self) -> int | None:
        """The newest point a global recovery may restore (``None``: no bound)."""
        return min(self.global_points) - 1 if self.global_points else None

    def merge(self, other: "Avoided") -> "Avoided":
        return Avoided({**other.localized, **self.localized}, {**other.global_points, **self.global_points})

    def to_json(self) -> dict:
        return {LOCALIZED: {str(k): v for k, v in sorted(self.localized.items())},
                GLOBAL: {str(k): v for k, v in sorted(self.global_points.items())}}

    @classmethod
    def from_json(cls, data: dict) -> "Avoided":
        return cls({int(k): v for k, v in data.get(LOCALIZED, {}).items()},
                   {int(k): v for k, v in data.get(GLOBAL, {}).items()})

    def __bool__(self) -> bool:
        return bool(self.localized or self.global_points)


class DecisionLedger:
    """This rank's record of failed decisions (``<job dir>/failed_decisions/rank<r>.json``)."""

    def __init__(self, job_dir: str, rank: int) -> None:
        self.path = os.path.join(job_dir, "failed_decisions", f"rank{rank}.json")

    def load(self) -> Avoided:
        """The recorded failures; an unreadable record (a damaged file) counts as none."""
        try:
            with open(self.path) as f:
                return Avoided.from_json(json.load(f))
        except (OSError, ValueError):
            return Avoided()

    def record(self, scope: str, iteration: int, why: str) -> None:
        """Add a failed decision (written atomically: a kill leaves the old record or the new one)."""
        avoided = self.load()
        (avoided.localized if scope == LOCALIZED else avoided.global_points)[iteration] = why[:300]
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(avoided.to_json(), f)
        os.replace(tmp, self.path)

    def clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
