"""The flexible token dispatcher (Lazarus §4.2, Alg. 1): schedule arithmetic, the permutation with its PyTorch reference and Triton kernels, and the Megatron dispatcher."""
