#!/usr/bin/env bash
# MoE GPT on H100 nodes in FP8 (Transformer Engine, hybrid E4M3/E5M2 with delayed scaling, bf16 elsewhere),
# with the same fault tolerance and layout as h200_bf16.sh (which runs it; every variable there applies):
#
#   NNODES=8 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node0 DATA=/lustre/data/corpus_text_document \
#     VOCAB=/lustre/tokenizer/gpt2-vocab.json MERGES=/lustre/tokenizer/gpt2-merges.txt bash examples/h100_fp8.sh
#
# Assumes: 8 H100 per node, NCCL, Transformer Engine installed (`pip install -e '.[fp8]'` on a CUDA machine;
# without it the script stops with a one-line error before launching any collective), an indexed dataset
# made with tools/preprocess_data.py and its tokenizer files, and a shared filesystem for SAVE.
# FP8 delayed scaling keeps an amax history and scales that the snapshots capture (docs/precision.md).
set -euo pipefail
cd "$(dirname "$0")/.."
SAVE=${SAVE:-checkpoints/moe_h100_fp8} JOB_ID=${JOB_ID:-moe_h100_fp8} \
  EXTRA="--fp8-format hybrid --fp8-recipe delayed ${EXTRA:-}" exec bash examples/h200_bf16.sh
