"""Who may write a handed-over point's regions: the trainer that allocated them, or the node agent it sent them to.

A trainer publishing by the node agent (``moe_ft/store/handoff.py``) hands the agent the regions of a point and
waits for the answer, at most a bound. An agent that answers late (it was stopped, or stuck) must not write
those regions once the trainer has given up on the order: the trainer frees them, and its next point is
copied into them. The point's staging marker, ``staging/<iteration>.<writer pid>.<token>``, is the token that
decides it, by operations on one name each, so that exactly one side wins:

* the agent *claims* the order before it writes a byte: it renames the marker to ``<marker>.<agent pid>`` (or
  takes over the claim of an agent that died, by renaming that name), and removes its claim when it is done,
  whether it linked the point or failed;
* the trainer *withdraws* an order that was not answered: it unlinks the marker (or a dead agent's claim). Once
  that succeeded, no agent writes the regions; where it fails, an agent holds the claim: while that agent lives
  the regions stay the point's (the allocator frees them, or takes them as the published point, once the
  claim is gone: ``_Allocator.settle``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from moe_ft.store.backend import pid_alive

WITHDRAWN = "withdrawn"
"""No agent wrote or will write the order's regions (:func:`withdraw`)."""
FINISHED = "finished"
"""An agent held the order and let go of it: it linked the point's index or failed, and writes no more."""


def _claims(staging: Path, marker: str) -> list[tuple[int, Path]]:
    """The claims of ``marker``: (the agent's pid, the claim's path)."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(staging):
            rest = name[len(marker) + 1:]
            if name.startswith(marker + ".") and rest.isdigit():
                out.append((int(rest), staging / name))
    return out


def claim(staging: Path, marker: str) -> bool:
    """The agent takes the order of ``marker`` before it writes its regions: ``True`` when this process holds it
    now (taken here, held already, or taken over from an agent that died), ``False`` when its writer withdrew it
    or another live agent holds it (then it must write nothing)."""
    mine = staging / f"{marker}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):  # gone: withdrawn, or claimed (here or by another agent)
        os.rename(staging / marker, mine)
        return True
    for pid, path in _claims(staging, marker):
        if pid == os.getpid():
            return True
        if not pid_alive(pid):
            with contextlib.suppress(FileNotFoundError):
                os.rename(path, mine)
                return True
    return False


def release(staging: Path, marker: str) -> None:
    """The agent is done with the order (the point linked, or the attempt failed): it writes no more."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging / f"{marker}.{os.getpid()}")


def withdraw(staging: Path, marker: str) -> str | int:
    """The trainer gives up on an unanswered order: :data:`WITHDRAWN` (no agent claimed it, or the one that did
    died, and none can now), :data:`FINISHED` (an agent claimed it and let go), else the pid of the live agent
    that holds it and may still write its regions."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging / marker)
        return WITHDRAWN
    for pid, path in _claims(staging, marker):
        if pid_alive(pid):
            return pid
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            return WITHDRAWN
    return FINISHED


def holder(staging: Path, marker: str) -> int | None:
    """The live agent holding ``marker``'s order after the trainer failed to withdraw it, else ``None`` (it let
    go, or died: then its claim is removed here, so that no agent takes it over)."""
    status = withdraw(staging, marker)
    return status if isinstance(status, int) else None


__all__ = ["FINISHED", "WITHDRAWN", "claim", "holder", "release", "withdraw"]
