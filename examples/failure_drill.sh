#!/usr/bin/env bash
# Failure drill on the tiny CPU job: a fault-free reference and a run with injected faults under
# moe-ft launch (a warm spare takes a killed rank, the other ranks keep their processes; --launcher torchrun:
# every worker restarts), final training-state digests compared bitwise (moe-ft drill).
#
#   bash examples/failure_drill.sh                                   # sparse, EP2xPP2, kill rank 1 at iteration 6
#   LAYOUT=dp2ep2 FAILS="--fail 2:5:snapshot --fail 1:4:recovery" bash examples/failure_drill.sh
#   POLICY=pec FAILS="--fail 0:7" bash examples/failure_drill.sh     # lossy: reports PLT
#   POLICY=dense FAILS="--fail 1:5 --fail 2:6:published:corrupt" EXTRA="--extra --ft-dense-interval 3" \
#     bash examples/failure_drill.sh                                 # dense(3); a corrupt entry is skipped
set -euo pipefail
cd "$(dirname "$0")/.."
LAYOUT=${LAYOUT:-ep2pp2}
POLICY=${POLICY:-sparse}
ITERS=${ITERS:-12}
WINDOW=${WINDOW:-3}
FAILS=${FAILS:---fail 1:6}
DATA_ARG=${DATA:+--data $DATA}
export OMP_NUM_THREADS=1
# shellcheck disable=SC2086
exec python -m moe_ft drill --layout "$LAYOUT" --policy "$POLICY" --iters "$ITERS" --window "$WINDOW" \
  --max-restarts "${MAX_RESTARTS:-3}" $FAILS $DATA_ARG ${EXTRA:-}
