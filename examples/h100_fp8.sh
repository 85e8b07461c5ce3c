#!/usr/bin/env bash
# MoE GPT on H100 nodes in FP8 (Transformer Engine, hybrid E4M3/E5M2 with delayed scaling, bf16 elsewhere).
#
#   NNODES=8 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node0 DATA=/lustre/data/corpus_text_document \
#     bash examples/h100_fp8.sh
#
# Assumes: 8 H100 per node, NCCL, Transformer Engine installed (`pip install -e '.[fp8]'` on a CUDA machine;
# without it the script stops with a one-line error before launching any collective), an indexed dataset
# made with tools/preprocess_data.py, and a shared filesystem for --save. Same layout as h200_bf16.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="--fp8-format hybrid --fp8-recipe delayed ${EXTRA:-}" exec bash examples/h200_bf16.sh
