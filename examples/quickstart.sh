#!/usr/bin/env bash
# The main job on a fresh clone (called by `make demo`, which created the venv and installed moe-ft):
#   1. prepare the default data (generated, no download) and show the environment;
#   2. train the tiny MoE GPT on CPU with 4 processes (EP=2 x PP=2, 1F1B) for 100 iterations, snapshotting
#      every iteration with the sparse policy (MoEvement) into a node-local store, plus Megatron checkpoints;
#   3. failure drill: the same job once fault-free and once with rank 1 SIGKILLed mid-window under
#      `moe-ft launch` (a warm spare takes rank 1, the other ranks keep their processes), sparse-to-dense
#      recovery replays the window, and the final training-state digests are compared bitwise;
#   4. checkpoint overhead of every policy, measured side by side in one job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/prepare_data.sh
moe-ft env
rm -rf runs/quickstart
STORE=${STORE:-/dev/shm/moe_ft_quickstart_$$}
trap 'rm -rf "$STORE"' EXIT

echo "== 1/3 training 100 iterations with per-iteration sparse snapshots (store: $STORE)"
SAVE=runs/quickstart LAYOUT=ep2pp2 \
  EXTRA="--ft --ft-policy sparse --ft-sparse-window 4 --ft-store-dir $STORE" bash examples/tiny_cpu.sh
moe-ft inspect "$(find "$STORE" -mindepth 2 -maxdepth 2 -type d | sort | head -n 1)" | tail -n 5

echo "== 2/3 failure drill: kill rank 1 at iteration 7 (inside a window), a spare takes it, recover, compare"
ITERS=12 WINDOW=3 FAILS="--fail 1:7" DATA=data/corpus bash examples/failure_drill.sh

echo "== 3/3 checkpoint overhead per policy (side by side in one job)"
python tools/bench/ckpt_overhead.py --quick --data-path data/corpus
