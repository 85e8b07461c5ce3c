"""The elastic runtime (Lazarus §4.3, §5): keep training when the world changes, and re-plan inside a run.

``config`` (``ElasticConfig``: the flexible dispatcher's replica map), ``component`` (``--ft-elastic``:
layout records, the restart decision), ``restart`` (fresh / same / reshape / fallback), ``inventory`` (what a
node still holds), ``reshape`` and ``restore`` (re-planning and moving operator state onto a new world),
``holders`` (which EP ranks hold which replicas), ``rebalance`` / ``live`` / ``rebalance_component``
(``--ft-rebalance-interval``: re-plan and swap expert slots in place). The planning math is in
``moe_ft.placement``; the dispatcher and its kernels in ``moe_ft.megatron_ext.dispatch``.
"""
