"""moe-ft: fault-tolerant training of Mixture-of-Experts GPT models on Megatron-Core."""

__version__ = "0.1.0"
