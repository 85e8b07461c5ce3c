"""The operator model of training state: operators, snapshot levels, plans."""

from moe_ft.state.operators import Level, OperatorId, OperatorInfo, SnapshotPlan

__all__ = ["Level", "OperatorId", "OperatorInfo", "SnapshotPlan"]
