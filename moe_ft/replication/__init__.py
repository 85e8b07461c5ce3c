"""Peer replication of snapshots: placement (MoEtion Alg. 2), transports, sender, receiver."""

from moe_ft.replication.placement import (
    ReplicaPlacementConfig,
    ReplicaPlan,
    has_copy_off_node,
    needs_replication,
    nodes_from_local_world_size,
    place_replicas,
)

__all__ = ["ReplicaPlacementConfig", "ReplicaPlan", "has_copy_off_node", "needs_replication",
           "nodes_from_local_world_size", "place_replicas"]
from moe_ft.replication.receiver import ReceiverConfig, Rejection, ReplicaReceiver, replica_store_config, verify_message
from moe_ft.replication.sender import ReplicaSender, SenderConfig
from moe_ft.replication.transport import (
    GlooTransport,
    GlooTransportConfig,
    InProcessHub,
    InProcessTransport,
    PointMessage,
    Transport,
)

__all__ += ["ReceiverConfig", "Rejection", "ReplicaReceiver", "replica_store_config", "verify_message",
            "ReplicaSender", "SenderConfig", "GlooTransport", "GlooTransportConfig", "InProcessHub",
            "InProcessTransport", "PointMessage", "Transport"]
