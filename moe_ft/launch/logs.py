"""Where each process of ``moe-ft launch`` writes its logs (torchrun's ``--log-dir``, ``--redirects``, ``--tee``)."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from string import Template

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std


@dataclass
class LaunchLogs:
    """Where each process's logs go (torchrun's ``--log-dir``, ``--redirects``, ``--tee``)."""

    root: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    line_prefix_template: str | None = None

    def __post_init__(self) -> None:
        if self.root is None:
            self.root = tempfile.mkdtemp(prefix="moe_ft_launch_")

    def specs(self, name: str, local_rank: int) -> DefaultLogsSpecs:
        """One process's log specification (a directory of its own: torch elastic clears an attempt's
        directory whenever a context starts, which would erase the other processes' error files)."""
        def pick(value):
            return value.get(local_rank, Std.NONE) if isinstance(value, dict) else value

        assert self.root is not None
        return DefaultLogsSpecs(log_dir=os.path.join(self.root, name), redirects=pick(self.redirects),
                                tee=pick(self.tee))

    def prefix(self, role: str, rank: int | str, local_rank: int) -> dict[int, str] | None:
        if not self.line_prefix_template:
            return None
        return {0: Template(self.line_prefix_template).safe_substitute(role_name=role, rank=rank,
                                                                         local_rank=local_rank)}
