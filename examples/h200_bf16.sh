#!/usr/bin/env bash
# MoE GPT on H200 nodes in bf16 (fp32 master weights, distributed optimizer) with per-iteration fault
# tolerance, launched on every node:
#
#   NNODES=4 NODE_RANK=$SLURM_NODEID MASTER_ADDR=node0 \
#     DATA="0.7 /lustre/data/web_text_document 0.3 /lustre/data/code_text_document" \
#     VOCAB=/lustre/tokenizer/gpt2-vocab.json MERGES=/lustre/tokenizer/gpt2-merges.txt \
#     bash examples/h200_bf16.sh
#
# Assumes:
# - NNODES nodes with 8 GPUs each (NPROC), NCCL, `pip install -e '.[gpu]'` (Transformer Engine for the TE
#   layer spec; IMPL=local uses Megatron-Core's local modules instead);
# - DATA: one Megatron indexed dataset prefix (<prefix>.bin/.idx from tools/preprocess_data.py or Megatron-LM's
#   preprocess_data.py), or weight/prefix pairs to blend several; DATA_CACHE: where the shuffled indices are
#   built once (default: beside SAVE);
# - the tokenizer the data was preprocessed with: TOKENIZER=GPT2BPETokenizer (default) with VOCAB and MERGES,
#   HuggingFaceTokenizer / SentencePieceTokenizer / TikTokenizer with TOKENIZER_MODEL, or NullTokenizer with
#   VOCAB_SIZE;
# - SAVE on a filesystem every node shares (Megatron checkpoints and the durable tier of the snapshots), and a
#   node-local tmpfs for the per-iteration snapshots (STORE, default /dev/shm/moe-ft: size it with
#   `moe-ft plan`, docs/store.md).
# Layout: EP=8 inside a node, PP=NNODES stages, DP fills the rest. Experts are SequentialMLP (no
# --moe-grouped-gemm): with the distributed optimizer the snapshots need each expert's own tensors.
# Fault tolerance: sparse per-iteration snapshots (MoEvement), one replica on another node, a durable copy every
# PERSIST iterations written by one node agent process per node (not by the trainers), localized recovery. `moe-ft launch` keeps the surviving processes and gives a failed rank
# to a warm spare: SPARES spare workers per node, each needs a GPU of its own (nodes with more GPUs than NPROC),
# else a fresh worker takes the failed rank. LAUNCHER=torchrun restarts every worker instead.
# DRY_RUN=1 prints the command, one argument per line, instead of running it.
set -euo pipefail
cd "$(dirname "$0")/.."
NNODES=${NNODES:-1}; NODE_RANK=${NODE_RANK:-0}; NPROC=${NPROC:-8}; SPARES=${SPARES:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}; MASTER_PORT=${MASTER_PORT:-29500}
DATA=${DATA:?set DATA to an indexed dataset prefix, or weight/prefix pairs to blend several}
SAVE=${SAVE:-checkpoints/moe_h200}
STORE=${STORE:-/dev/shm/moe-ft}
PERSIST=${PERSIST:-100}
PP=${PP:-$NNODES}; EP=${EP:-8}; IMPL=${IMPL:-transformer_engine}
TOKENIZER=${TOKENIZER:-GPT2BPETokenizer}
read -r -a DATA_ARGS <<< "$DATA"
case "$TOKENIZER" in
  GPT2BPETokenizer) TOKENIZER_ARGS=(--vocab-file "${VOCAB:?set VOCAB to the GPT-2 vocab.json}"
                                    --merge-file "${MERGES:?set MERGES to the GPT-2 merges.txt}") ;;
  HuggingFaceTokenizer|SentencePieceTokenizer|TikTokenizer)
    TOKENIZER_ARGS=(--tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the tokenizer file}") ;;
  NullTokenizer) TOKENIZER_ARGS=(--vocab-size "${VOCAB_SIZE:?set VOCAB_SIZE}") ;;
  *) echo "unknown TOKENIZER=$TOKENIZER" >&2; exit 2 ;;
esac
case "${LAUNCHER:-inprocess}" in
  inprocess) LAUNCH=(moe-ft launch --spares-per-node "$SPARES") ;;
  torchrun) LAUNCH=(torchrun) ;;
  *) echo "unknown LAUNCHER=$LAUNCHER (inprocess or torchrun)" >&2; exit 2 ;;
esac
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
CMD=("${LAUNCH[@]}" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC"
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${JOB_ID:-moe_h200}"
  --max-restarts "${MAX_RESTARTS:-3}"
  pretrain_gpt_moe.py
  --transformer-impl "$IMPL" --bf16
  --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 1408
  --seq-length 4096 --max-position-embeddings 4096
  --num-experts 64 --moe-router-topk 6 --moe-aux-loss-coeff 0.001
  --moe-token-dispatcher-type alltoall
  --expert-model-parallel-size "$EP" --pipeline-model-parallel-size "$PP" --use-distributed-optimizer
  --micro-batch-size 1 --global-batch-size 512
  --train-iters 100000 --lr 4.2e-4 --min-lr 4.2e-5 --lr-decay-style cosine --lr-warmup-iters 2000
  --weight-decay 0.1 --clip-grad 1.0 --seed 1234 --num-threads 4
  --data-path "${DATA_ARGS[@]}" --split 99,1,0 --data-cache-path "${DATA_CACHE:-$SAVE/data_cache}"
  --num-workers 2 --tokenizer-type "$TOKENIZER" "${TOKENIZER_ARGS[@]}"
  --log-interval 10 --eval-interval 1000 --eval-iters 10
  --save "$SAVE" --save-interval 1000
  --ft --ft-policy sparse --ft-store-dir "$STORE" --ft-replicas 1 --ft-ranks-per-node "$NPROC"
  --ft-persist-interval "$PERSIST" --ft-persist-dir "$SAVE/ft" --ft-persist-agent --ft-report-dir "$SAVE/ft_reports"
  "${EXTRA_ARGS[@]}")
if [[ -n "${DRY_RUN:-}" ]]; then
  printf '%s\n' "${CMD[@]}"
  exit 0
fi
exec "${CMD[@]}"
