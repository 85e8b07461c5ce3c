#!/usr/bin/env bash
# Make the default corpus (generated deterministically, no download) and its Megatron indexed dataset.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-data/corpus}
if [ -f "$OUT.bin" ] && [ -f "$OUT.idx" ]; then echo "dataset $OUT exists"; exit 0; fi
python tools/make_corpus.py --output "$OUT.jsonl" --num-docs "${NUM_DOCS:-2000}" --seed 0
python tools/preprocess_data.py --input "$OUT.jsonl" --output-prefix "$OUT" --append-eod
