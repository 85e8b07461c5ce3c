"""Two-level persistence (MoC §5.1): the durable tier and its background writer."""

from moe_ft.persist.durable import CompletePoint, DurableTier, point_from_json, point_to_json
from moe_ft.persist.writer import PersistRecord, PersistWriter

__all__ = ["CompletePoint", "DurableTier", "PersistRecord", "PersistWriter", "point_from_json",
           "point_to_json"]
