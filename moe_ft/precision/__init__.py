"""Precision-aware training state (MoEvement §5.7, Table 7).

* :mod:`moe_ft.precision.fp8` — FP8 weights with per-tensor delayed scaling in plain PyTorch (the
  reference semantics of the CPU emulation, ``--fp8-emulation``);
* :mod:`moe_ft.precision.quantized` — quantized weights decomposed into the plain tensors snapshots store
  (emulation state, duck-typed Transformer Engine ``Float8Tensor`` and ``fp8_meta``);
* :mod:`moe_ft.precision.scaler` — the fp16 loss scaler as per-iteration state;
* :mod:`moe_ft.precision.config` — the dtype of each kind of state and which combinations ``--ft``
  recovers exactly.

The Megatron layers of the emulation are in ``moe_ft/megatron_ext/fp8_linear.py``.
"""

from moe_ft.precision.config import PrecisionConfig
from moe_ft.precision.fp8 import DelayedScalingConfig, FP8WeightState
from moe_ft.precision.quantized import QuantizedWeight, quantized_state, quantized_tensors

__all__ = ["DelayedScalingConfig", "FP8WeightState", "PrecisionConfig", "QuantizedWeight", "quantized_state",
           "quantized_tensors"]
