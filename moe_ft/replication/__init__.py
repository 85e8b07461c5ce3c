"""Peer replication of snapshots (issue 5): placement (MoEtion Alg. 2), transports, sender, receiver."""

from moe_ft.replication.placement import (PlacementConfig, ReplicaPlan, has_copy_off_node,
                                          needs_replication, nodes_from_local_world_size, place_replicas)

__all__ = ["PlacementConfig", "ReplicaPlan", "has_copy_off_node", "needs_replication",
           "nodes_from_local_world_size", "place_replicas"]
