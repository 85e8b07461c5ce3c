"""Snapshot policies: small objects that map each iteration to a snapshot plan.

``build_policy(name, config, operators)`` builds one of ``dense``, ``pec`` (MoC), ``selective`` (MoEtion)
or ``sparse`` (MoEvement, the default). See ``docs/policies.md``.
"""

from moe_ft.policy.base import SnapshotPolicy
from moe_ft.policy.dense import DenseConfig, DensePolicy
from moe_ft.policy.factory import DEFAULT_POLICY, NO_SNAPSHOTS, POLICIES, POLICY_CHOICES, build_policy, policy_class
from moe_ft.policy.pec import PECConfig, PECPolicy
from moe_ft.policy.selective import SelectiveConfig, SelectivePolicy
from moe_ft.policy.sparse import SparseConfig, SparsePolicy
from moe_ft.policy.sparse_schedule import SparseWindow

__all__ = [
    "DEFAULT_POLICY", "NO_SNAPSHOTS", "POLICIES", "POLICY_CHOICES", "policy_class", "DenseConfig", "DensePolicy", "PECConfig", "PECPolicy", "SelectiveConfig",
    "SelectivePolicy", "SnapshotPolicy", "SparseConfig", "SparsePolicy", "SparseWindow", "build_policy",
]
