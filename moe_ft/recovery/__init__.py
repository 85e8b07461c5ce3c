"""Recovery after a failure: agreement on a recovery point, sparse-to-dense replay (exact),
dense restore, lossy restore with token-loss accounting. See ``docs/recovery.md``."""

from moe_ft.recovery.machine import MachineConfig, Phase, Recovery, RecoveryContext, RecoveryState
from moe_ft.recovery.report import RecoveryReport

__all__ = ["Phase", "Recovery", "MachineConfig", "RecoveryContext", "RecoveryReport", "RecoveryState"]
