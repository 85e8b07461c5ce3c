#!/usr/bin/env bash
# MoE GPT on H200 nodes in bf16 (fp32 master weights, distributed optimizer), launched on every node:
#
#   NNODES=4 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node0 DATA=/lustre/data/corpus_text_document \
#     bash examples/h200_bf16.sh
#
# Assumes: 8 GPUs per node, NCCL, `pip install -e '.[gpu]'` (Transformer Engine for the TE layer spec;
# drop --transformer-impl transformer_engine to use Megatron-Core's local modules), a Megatron indexed
# dataset made with tools/preprocess_data.py, and a shared filesystem for --save.
# Layout: 8 experts per GPU group (EP=8) inside a node, PP=NNODES stages; DP fills the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}; MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-29500}
DATA=${DATA:?set DATA to the prefix of an indexed dataset}
SAVE=${SAVE:-checkpoints/moe_h200}
PP=${PP:-$NNODES}
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node 8 \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --max-restarts "${MAX_RESTARTS:-3}" \
  pretrain_gpt_moe.py \
  --transformer-impl transformer_engine --bf16 \
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 1408 \
  --seq-length 4096 --max-position-embeddings 4096 \
  --num-experts 64 --moe-router-topk 6 --moe-aux-loss-coeff 0.001 --moe-grouped-gemm \
  --moe-token-dispatcher-type alltoall \
  --expert-model-parallel-size 8 --pipeline-model-parallel-size "$PP" --use-distributed-optimizer \
  --micro-batch-size 1 --global-batch-size 512 \
  --train-iters 100000 --lr 4.2e-4 --min-lr 4.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000 \
  --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --num-threads 4 \
  --data-path "$DATA" --split 99,1,0 \
  --log-interval 10 --eval-interval 1000 --eval-iters 10 \
  --save "$SAVE" --save-interval 1000 ${EXTRA:-}
