#!/usr/bin/env bash
# Node-loss drill on the tiny CPU job: 2 simulated nodes x 2 ranks (two moe-ft launch agents, one warm spare
# each, on a c10d rendezvous hosted by the drill), each node with its own store, replicas on the other node.
# A lost node's agent and workers are SIGKILLed at once and its store is deleted; with one spare for its two
# ranks the survivors wait in their processes for a replacement agent, which joins (--launcher torchrun: every
# worker restarts); the final training-state digest is compared bitwise with a fault-free run (moe-ft drill
# --nodes, docs/drills.md).
#
#   bash examples/node_drill.sh                                        # EP2xPP2, node 1 lost at iteration 6
#   LAYOUT=dp2ep2 LOSSES="--fail-node 0:5:snapshot" bash examples/node_drill.sh   # node 0, copy in flight
#   LOSSES="--fail-node 1:7:persist" bash examples/node_drill.sh       # lost while the durable tier writes 7
#   LOSSES="--fail-node 0:9 --fail-node 1:9" bash examples/node_drill.sh  # both nodes: durable-tier fallback
#   bash examples/node_drill.sh --json --keep-store                    # more drill flags pass through
set -euo pipefail
cd "$(dirname "$0")/.."
LAYOUT=${LAYOUT:-ep2pp2}
POLICY=${POLICY:-sparse}
ITERS=${ITERS:-12}
WINDOW=${WINDOW:-4}
LOSSES=${LOSSES:---fail-node 1:6}
DATA_ARG=${DATA:+--data $DATA}
export OMP_NUM_THREADS=1
# shellcheck disable=SC2086
exec python -m moe_ft drill --nodes 2 --layout "$LAYOUT" --policy "$POLICY" --iters "$ITERS" --window "$WINDOW" \
  --max-restarts "${MAX_RESTARTS:-3}" $LOSSES ${FAILS:-} $DATA_ARG "$@" ${EXTRA:-}  # EXTRA (--extra …) last: it takes the rest
