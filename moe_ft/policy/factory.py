"""``build_policy``: name + config → policy object."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

from moe_ft.policy.base import SnapshotPolicy
from moe_ft.policy.dense import DenseConfig, DensePolicy
from moe_ft.policy.pec import PECConfig, PECPolicy
from moe_ft.policy.selective import SelectiveConfig, SelectivePolicy
from moe_ft.policy.sparse import SparseConfig, SparsePolicy
from moe_ft.state.operators import OperatorInfo

POLICIES: Mapping[str, tuple[type, Any]] = {  # (policy class, its config dataclass)
    "dense": (DensePolicy, DenseConfig),
    "pec": (PECPolicy, PECConfig),
    "selective": (SelectivePolicy, SelectiveConfig),
    "sparse": (SparsePolicy, SparseConfig),
}
"""Policy name → (policy class, config class)."""

DEFAULT_POLICY = "sparse"

NO_SNAPSHOTS = "none"
"""``--ft-policy none``: popularity is counted and logged, nothing is snapshotted (no store, no engine)."""

POLICY_CHOICES = [NO_SNAPSHOTS, *sorted(POLICIES)]
"""Values of ``--ft-policy``."""


def policy_class(name: str) -> Optional[type[SnapshotPolicy]]:
    """The policy class of ``--ft-policy name`` (``None`` for ``none``); class attributes such as
    :attr:`SnapshotPolicy.lossy` answer questions asked before any policy object exists."""
    if name == NO_SNAPSHOTS:
        return None
    if name not in POLICIES:
        raise ValueError(f"unknown snapshot policy {name!r}; expected one of {POLICY_CHOICES}")
    return POLICIES[name][0]


def build_policy(name: str, config: Optional[Union[Any, Mapping[str, Any]]],
                 operators: Sequence[OperatorInfo]) -> SnapshotPolicy:
    """Build policy ``name`` from its config dataclass, a mapping of its fields (e.g. parsed flags), or
    ``None`` for the defaults; ``operators`` is the global operator catalogue."""
    if name not in POLICIES:
        raise ValueError(f"unknown snapshot policy {name!r}; expected one of {sorted(POLICIES)}")
    policy_cls, config_cls = POLICIES[name]
    if config is None:
        config = config_cls()
    elif isinstance(config, Mapping):
        unknown = sorted(set(config) - set(config_cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{config_cls.__name__} has no field(s) {unknown}; "
                             f"valid: {sorted(config_cls.__dataclass_fields__)}")
        config = config_cls(**config)
    elif not isinstance(config, config_cls):
        raise ValueError(f"policy {name!r} takes a {config_cls.__name__}, got {type(config).__name__}")
    return policy_cls(config, operators)
