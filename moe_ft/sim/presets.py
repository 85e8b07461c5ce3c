"""Named configurations for the settings the papers evaluate.

Models: MoEvement Table 2 with the (PP, DP, EP) plans of §5.1 on the Azure A100 cluster of §5.1; the
DeepSeek-MoE runs of §5.7 on the H100 cluster (five precisions of Table 7); and the DeepSeek-MoE scaling
runs of §5.4 (512 to 16384 GPUs). Table 2 gives layers, experts, top-k and parameter counts only; hidden
and FFN sizes and vocabularies come from the public model cards the table cites, and where Table 2 and the
model card disagree we say so in ``docs/simulator.md``. The scaling models of §5.4 are "DeepSeek-class"
shapes sized to the stated totals (the paper does not give their shapes).
"""

from __future__ import annotations

import dataclasses

from moe_ft.sim.config import PRECISIONS, HardwareSpec, ModelSpec, ParallelSpec, SimConfig

GB = 1e9

# MoEvement §5.1: 12 × Standard_NC96ads_A100_v4, 8 A100-80GB, NVLink 600 GB/s, 80 Gb/s network per node,
# 40 Gb/s aggregate to Blob storage. PCIe 4.0 x16 effective D2H ≈ 20 GB/s (not given by the paper).
A100_AZURE = HardwareSpec(
    name="azure-a100", gpus_per_node=8, peak_flops_bf16=312e12, mfu=0.4, hbm_bytes=80 * GB,
    hbm_bandwidth=2.0e12, d2h_bandwidth=20 * GB, nvlink_bandwidth=300 * GB,
    network_bandwidth=80e9 / 8 / 8, storage_bandwidth=40e9 / 8,
)
# MoEvement §5.7: 16 nodes × 8 H100-80GB, NVLink 900 GB/s, 200 Gb/s InfiniBand per node.
H100_IB200 = HardwareSpec(
    name="h100-ib200", gpus_per_node=8, peak_flops_bf16=989e12, peak_flops_fp8=1979e12, mfu=0.4,
    hbm_bytes=80 * GB, hbm_bandwidth=3.35e12, d2h_bandwidth=40 * GB, nvlink_bandwidth=450 * GB,
    network_bandwidth=200e9 / 8 / 8, storage_bandwidth=40e9 / 8,
)
# MoEvement §5.4 does not name the hardware of its scaling simulation; we use an H200 cluster with one
# 400 Gb/s NIC per GPU (the setup of Lazarus §6.7).
H200_NDR = HardwareSpec(
    name="h200-ndr400", gpus_per_node=8, peak_flops_bf16=989e12, peak_flops_fp8=1979e12, mfu=0.4,
    hbm_bytes=141 * GB, hbm_bandwidth=4.8e12, d2h_bandwidth=50 * GB, nvlink_bandwidth=450 * GB,
    network_bandwidth=400e9 / 8, storage_bandwidth=400 * GB,
)

_TABLE2 = {
    # MoE-LLaVA-StableLM-1.6B×4: 24 layers (Table 2 says 32; 2.9B total only fits 24), MoE every 2nd layer.
    "moe-llava": ModelSpec(name="MoE-LLaVa", num_layers=24, hidden_size=2048, ffn_hidden_size=5632,
                           moe_ffn_hidden_size=5632, num_experts=4, top_k=2, vocab_size=100352,
                           seq_length=2048, moe_layer_interval=2),
    "gpt-moe": ModelSpec(name="GPT-MoE", num_layers=12, hidden_size=2048, ffn_hidden_size=8192,
                         moe_ffn_hidden_size=4352, num_experts=32, top_k=6, vocab_size=50304, seq_length=2048,
                         gated_ffn=False, tie_embeddings=True),
    # Qwen1.5-MoE-A2.7B has 60 routed + 4 shared experts (top-4 routed); Table 2 counts them as 64, top-8.
    # We follow Table 2 (same parameter count, and 64 divides by EP = 8 where 60 does not).
    "qwen-moe": ModelSpec(name="QWen-MoE", num_layers=24, hidden_size=2048, ffn_hidden_size=5632,
                          moe_ffn_hidden_size=1408, num_experts=64, top_k=8, vocab_size=151936, seq_length=2048),
    # DeepSeekMoE-16B: 64 routed, 2 shared, first layer dense (model card: top-6; Table 2 says top-8).
    "deepseek-moe-16b": ModelSpec(name="DeepSeek-MoE-16.4B", num_layers=28, hidden_size=2048,
                                  ffn_hidden_size=10944, moe_ffn_hidden_size=1408, num_experts=64, top_k=6,
                                  num_shared_experts=2, vocab_size=102400, seq_length=2048, first_dense_layers=1),
}
# (PP, DP_expert, EP) of §5.1. MoE-LLaVa is given EP 8 with 4 experts, which cannot be; we use EP 4 and
# twice the expert data parallelism (same 96 GPUs).
_PLANS = {"moe-llava": (6, 4, 4), "gpt-moe": (3, 4, 8), "qwen-moe": (6, 2, 8), "deepseek-moe-16b": (12, 1, 8)}

# §5.4 scaling runs: (GPUs, stages, pipelines) = (512, 16, 4), (1536, 24, 8), (4096, 32, 16), (16384, 64, 32),
# all with EP = 8: world = pp · pipelines · 8.
_SCALING = {
    "deepseek-moe-32b": (ModelSpec(name="DeepSeek-MoE-32B", num_layers=32, hidden_size=2560, ffn_hidden_size=13824,
                                   moe_ffn_hidden_size=1920, num_experts=64, top_k=6, num_shared_experts=2,
                                   vocab_size=102400, seq_length=4096, first_dense_layers=1), 16, 4),
    "deepseek-moe-67b": (ModelSpec(name="DeepSeek-MoE-67B", num_layers=48, hidden_size=3072, ffn_hidden_size=16384,
                                   moe_ffn_hidden_size=1536, num_experts=96, top_k=8, num_shared_experts=2,
                                   vocab_size=102400, seq_length=4096, first_dense_layers=1), 24, 8),
    "deepseek-moe-145b": (ModelSpec(name="DeepSeek-MoE-145B", num_layers=64, hidden_size=4096, ffn_hidden_size=16384,
                                    moe_ffn_hidden_size=1376, num_experts=128, top_k=12, num_shared_experts=4,
                                    vocab_size=102400, seq_length=4096, first_dense_layers=1), 32, 16),
    # DeepSeek-V3 shape with 64 layers: the paper's 64 stages cannot hold V3's 61 layers one per stage.
    "deepseek-v3-671b": (ModelSpec(name="DeepSeek-V3-class-671B", num_layers=64, hidden_size=7168,
                                   ffn_hidden_size=18432, moe_ffn_hidden_size=2048, num_experts=256, top_k=8,
                                   num_shared_experts=1, vocab_size=129280, seq_length=4096, first_dense_layers=3,
                                   attention_params_per_layer=187_000_000), 64, 32),
}


def _table2(key: str, hardware: HardwareSpec, precision: str, suffix: str = "") -> SimConfig:
    pp, dp_expert, ep = _PLANS[key]
    return SimConfig(
        name=key + suffix, model=_TABLE2[key],
        # §5.1: batch 512, micro-batch 32 sequences per pipeline, split over the EP ranks of a replica.
        parallel=ParallelSpec(tp=1, pp=pp, dp=dp_expert * ep, ep=ep, micro_batch_size=32 // ep,
                              global_batch_size=512),
        precision=PRECISIONS[precision], hardware=hardware,
    )


def build_presets() -> dict[str, SimConfig]:
    """All named presets (built on call; nothing is constructed at import time)."""
    presets: dict[str, SimConfig] = {}
    for key in _TABLE2:
        presets[key] = _table2(key, A100_AZURE, "mixed")
    base = _table2("deepseek-moe-16b", H100_IB200, "mixed")
    for prec in PRECISIONS:
        if prec == "mixed":
            continue
        presets[f"deepseek-moe-16b-h100-{prec}"] = dataclasses.replace(
            base, name=f"deepseek-moe-16b-h100-{prec}", precision=PRECISIONS[prec],
            parallel=dataclasses.replace(base.parallel, pp=8, dp=16),  # §5.7: PP 8, DP 2, EP 8
        )
    for key, (model, stages, pipelines) in _SCALING.items():
        presets[key] = SimConfig(
            name=key, model=model,
            parallel=ParallelSpec(tp=1, pp=stages, dp=pipelines * 8, ep=8, micro_batch_size=1,
                                  global_batch_size=pipelines * 8 * 2 * stages),  # M = 2·stages
            precision=PRECISIONS["mixed"], hardware=H200_NDR,
        )
    return presets


def get_preset(name: str) -> SimConfig:
    presets = build_presets()
    if name not in presets:
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(sorted(presets))}")
    return presets[name]
