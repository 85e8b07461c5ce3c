"""The end of training closes every snapshot session and component even when one of them fails (a replication
that cannot end its streams must not skip the durable tier's final flush), then raises the first failure."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moe_ft.config import FTConfig
from moe_ft.runtime.components import Component
from moe_ft.runtime.hooks import FTRuntime


class _Closing(Component):
    def __init__(self, name: str, closed: list[str], error: Exception | None = None) -> None:
        self.name, self.closed, self.error = name, closed, error

    def close(self) -> None:
        self.closed.append(self.name)
        if self.error is not None:
            raise self.error


def test_train_end_closes_every_component_then_raises_the_first_failure(capsys):
    closed: list[str] = []
    runtime = FTRuntime(FTConfig())
    runtime.rank = 0
    runtime.sessions = [SimpleNamespace(close=lambda: closed.append("session"))]
    runtime.components = [_Closing("replicas", closed, RuntimeError("holder unreachable")),
                          _Closing("trace", closed, ValueError("disk full")), _Closing("durable", closed)]
    with pytest.raises(RuntimeError, match="holder unreachable"):
        runtime.on_train_end(SimpleNamespace(last_iteration=5))
    assert closed == ["session", "replicas", "trace", "durable"]  # the durable tier's final flush ran
    assert "also: ValueError: disk full" in capsys.readouterr().err


def test_a_replication_whose_streams_did_not_end_still_says_bye_to_its_node_agent():
    """The node agent leaves once every rank said bye: a rank whose wait for its sources' streams failed says
    it all the same (else its agent would stay until its idle exit), and the failure is raised."""
    from moe_ft.agent.replication import AgentSender
    from moe_ft.replication.service import Replication

    calls: list[str] = []
    sender = object.__new__(AgentSender)  # its close and client only
    sender.close = lambda: calls.append("streams ended")  # type: ignore[method-assign]
    sender.client = SimpleNamespace(bye=lambda: calls.append("bye"))

    def join(timeout):
        raise TimeoutError("replicas from rank(s) [1]: their node agents have not ended their streams")

    replication = SimpleNamespace(sender=sender, receiver=SimpleNamespace(join=join), capture=None)
    with pytest.raises(TimeoutError):
        Replication.close(replication)  # type: ignore[arg-type]
    assert calls == ["streams ended", "bye"]
