"""moe-ft's extensions of Megatron-Core, installed through layer specs (never by patching Megatron)."""
