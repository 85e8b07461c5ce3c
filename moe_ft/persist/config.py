"""The durable tier's flags (``--ft-persist-*``), which are also its writers' configuration, and its build:
background copies of recovery points to shared storage, by the trainers or by the node agent
(``moe_ft/persist/component.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from megatron.training.argument_utils import field_help, non_negative

if TYPE_CHECKING:
    from moe_ft.runtime.context import BuildContext


@dataclass(kw_only=True)
class DurableConfig:
    """The durable tier: background copies of recovery points to shared storage (MoC §5.1 two-level)."""

    interval: int = field(default=0, metadata=field_help(
        "Copy the newest recovery point to durable storage every N iterations in the background (0 = off)."))
    dir: str = field(default="", metadata=field_help(
        "Durable tier root (<dir>/moe_ft/<job>); empty = --save."))
    agent: bool = field(default=False, metadata=field_help(
        "The node agent (one niced process per node, started by the first rank that needs it, outliving the "
        "workers) copies the points to the durable tier; the trainers only tell it which iteration."))
    agent_idle_exit: float = field(default=600.0, metadata=field_help(
        "The node agent exits after this many seconds without a connected trainer (the job died and did not "
        "come back); at a clean end it exits once every rank is done."))

    keep: int = field(default=2, metadata=field_help(
        "Complete durable points kept (the newest complete one is never deleted)."))
    publish_timeout: float = field(default=300.0, metadata=field_help(
        "Seconds the writer waits for the node-local point of a due iteration to be published."))

    def __post_init__(self) -> None:
        non_negative(self, ("interval", "publish_timeout"), "ft_persist_")
        if self.keep < 1:
            raise ValueError(f"--ft-persist-keep must be >= 1 (the newest complete point is never deleted), got "
                             f"{self.keep}")

    def root(self, save_dir: str | None) -> str:
        return self.dir or save_dir or ""

    def resolved(self, save_dir: str | None) -> "DurableConfig":
        """This configuration with its root decided (``--ft-persist-dir``, else ``--save``); a ``ValueError``
        naming the fix when an interval has nowhere to write."""
        out = replace(self, dir=self.root(save_dir))
        if out.interval and not out.dir:
            raise ValueError("--ft-persist-interval needs a durable directory: pass --ft-persist-dir or --save")
        return out

    def check_args(self, args) -> None:
        """Checks against the training flags (``FTConfig.check_args``, at parsing): an interval needs a
        directory to write to (:meth:`resolved`'s refusal, before any process group rather than after the
        first iteration, when the writer is built)."""
        if self.interval:
            self.resolved(args.training.save)

    def build(self, ctx: "BuildContext", session):
        """The durable writer of ``session``'s store (plus Megatron-format copies when the policy's points
        are dense), or ``None``."""
        if session is None or not self.interval:
            return None

        # start-up time: flag parsing must not import Megatron-Core's model code (one-line errors, fast --help)
        from moe_ft.persist.component import Durable

        return Durable.build(self.resolved(ctx.args.training.save), ctx, session)
