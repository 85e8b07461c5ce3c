#!/usr/bin/env bash
# The main job on a fresh clone (called by `make demo`, which created the venv and installed moe-ft):
# prepare the default data, show the environment, train the tiny MoE GPT on CPU with 4 processes (EP=2 x PP=2),
# then resume it from its iteration-50 checkpoint and check the resumed run ends in the same state.
set -euo pipefail
cd "$(dirname "$0")/.."
bash examples/prepare_data.sh
moe-ft env
rm -rf runs/quickstart runs/quickstart_resume
echo "== training 100 iterations (checkpoints at 50 and 100)"
SAVE=runs/quickstart LAYOUT=ep2pp2 bash examples/tiny_cpu.sh
echo "== resuming from iteration 50"
mkdir -p runs/quickstart_resume
cp -r runs/quickstart/iter_0000050 runs/quickstart_resume/ && echo 50 > runs/quickstart_resume/latest_checkpointed_iteration.txt
SAVE=runs/quickstart_resume LAYOUT=ep2pp2 EXTRA="--load runs/quickstart_resume" bash examples/tiny_cpu.sh
echo "== comparing the two iteration-100 checkpoints"
python tools/compare_checkpoints.py runs/quickstart/iter_0000100 runs/quickstart_resume/iter_0000100
