"""Installs ``megatron.training`` (a namespace portion beside pip's ``megatron.core``), ``moe_ft`` and
the entry script. CPU-only by default: ``torch==2.13.0`` is pinned exactly so that a fresh install takes
the CPU wheel; GPU extras (Transformer Engine, DALI) are optional and never needed on CPU."""

from setuptools import Extension, find_namespace_packages, setup

setup(
    name="moe-ft",
    version="0.1.0",
    description="Fault-tolerant training of Mixture-of-Experts GPT models on Megatron-Core",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["moe_ft", "moe_ft.*", "megatron.training", "megatron.training.*"]),
    py_modules=["pretrain_gpt_moe"],
    # The store's mfh64 checksum in C, with a copy that hashes as it goes (moe_ft/store/_mfh64.c): optional, so a
    # machine without a C compiler installs and runs on the NumPy reference (the CPU snapshot path then keeps
    # xxh3_64, hashed and written in two passes).
    ext_modules=[Extension("moe_ft.store._mfh64", ["moe_ft/store/_mfh64.c"], extra_compile_args=["-O3"],
                           optional=True)],
    install_requires=[
        "torch==2.13.0",
        "megatron-core==0.16.1",
        "numpy>=1.26",
        # dist_checkpointing's writer processes need psutil; without it they die and the save hangs.
        "psutil>=5.9",
        # store checksums: XXH3-64, ~5x zlib's crc32 on this hardware (docs/store.md "Checksum choice")
        "xxhash==4.1.0",
    ],
    extras_require={
        "test": [
            "pytest>=8", "pytest-timeout>=2.3", "triton==3.9.0", "matplotlib>=3.8",
            # `make test` runs the suite on two workers (its drills wait on peers, timeouts and imports: one
            # worker leaves a core idle most of the time)
            "pytest-xdist==3.8.0",
            # `make test` lints and type-checks before pytest; pinned so a new release cannot break the build.
            "ruff==0.17.6", "mypy==2.4.1",
            # the tokenizer tests train a GPT-2 BPE vocabulary and a SentencePiece model offline, write TikToken ranks
            "tokenizers==0.23.3", "sentencepiece==0.2.3", "tiktoken==0.12.0",
        ],
        # --tokenizer-type GPT2BPETokenizer / HuggingFaceTokenizer, SentencePieceTokenizer, TikTokenizer
        "tokenizers": ["tokenizers>=0.20", "sentencepiece>=0.2", "tiktoken>=0.7"],
        "triton": ["triton==3.9.0"],
        "plot": ["matplotlib>=3.8"],
        # GPU extras: need CUDA to build/run; import-guarded everywhere, never used on CPU. Transformer Engine in
        # the range megatron-core 0.16.1 is built and tested with (its own `dev` extra).
        "gpu": ["transformer-engine[pytorch]>=2.9.0,<2.12.0", "nvidia-dali-cuda120"],
        "fp8": ["transformer-engine[pytorch]>=2.9.0,<2.12.0"],
    },
    entry_points={"console_scripts": ["moe-ft=moe_ft.cli.main:main"]},
)
