"""The layouts ``--ft-optimizer-recompute`` cannot serve, one message each: refused from the flags at parsing
(``ReplicationConfig.check_args``) and again on the built optimizer and registry
(``optim_recompute.main_params``), for callers that build a capture without the parser. Kept apart from
``optim_recompute.py`` so that flag parsing does not import torch or Megatron-Core."""

DISTRIBUTED_OPTIMIZER = ("--ft-optimizer-recompute does not support --use-distributed-optimizer: the peer would hold "
                         "one data-parallel shard of each expert and cannot rebuild its compute weights; drop one of "
                         "the two flags")

GROUPED_MLP = ("--ft-optimizer-recompute replays each expert's own optimizer step, and GroupedMLP (--moe-grouped-gemm "
               "with --transformer-impl local) keeps a layer's experts in one weight with no optimizer state of "
               "their own: drop --moe-grouped-gemm (SequentialMLP experts) or --ft-optimizer-recompute")

FP8_WEIGHTS = ("--ft-optimizer-recompute does not support FP8 weights (--fp8-emulation): the peer would have to "
               "re-quantize the expert's weights with the owner's scaling state; drop one of the two flags")
