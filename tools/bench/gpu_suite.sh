#!/usr/bin/env bash
# GPU checks and benchmarks on one CUDA device (docs/benchmarks.md "GPU (H100)").
#
#   bash tools/bench/gpu_suite.sh OUT_DIR            # every stage
#   STAGES="units overhead" bash tools/bench/gpu_suite.sh OUT_DIR
#
# Stages: snapshot (tools/bench/gpu_snapshot.py), hash (gpu_hash.py: the device checksum), dispatch (gpu_dispatch.py), units (tests/gpu without the
# end-to-end drill, plus the gpu-marked tests elsewhere), recovery (tests/gpu/test_gpu_recovery.py),
# overhead (gpu_overhead.py; --ft-snapshot-bandwidth from the snapshot stage's store write rate when present),
# interleave (gpu_overhead.py --interleave: snapshots taken and paused in blocks inside one launch, the worker's
# profile and the GIL probe; then the per-block trace without the none launch), cpubound (the CPU acceptance row,
# tools/bench/ckpt_overhead.py, on the host's cores with the GPU hidden: sparse, sparse with the agent's hash,
# and the control), pace (gpu_copy_queue.py: a read from the device behind a snapshot copy, one copy, paced or by
# the hash kernel; then gpu_overhead.py --interleave with the copy in one piece, paced in 16 MiB pieces and by
# the kernel on 16 programs, alternating launches), steps
# (gpu_overhead.py --interleave --steps copy hash: what the copy alone, then with the device hash, then the whole
# path costs, one launch each), decide (tests/gpu/test_gpu_mapped.py, then the one DMA copy against the kernel's
# copy in 320-iteration launches, then the kernel's copy with sys.setswitchinterval(0.0005); ~8 minutes on an
# H200), hooks (tools/bench/ft_hooks.py: the training thread's time in each FT hook and its steps, the copy by
# the copy engine and by the kernel; ~2 minutes), agent (tests/gpu/test_gpu_mapped.py, then the kernel's copy, each
# point published by the trainer and by the node agent, --ft-publish-by agent; ~7 minutes). Not in the default list: STAGES="agent hooks decide
# pace steps interleave cpubound" runs them.
# Each stage writes OUT_DIR/<file>.json or .log and its stderr to <file>.err; the tests' numbers land in OUT_DIR/results/*.json.
set -u
OUT=${1:-gpu_results}
STAGES=${STAGES:-"snapshot hash dispatch units recovery overhead"}
PY=${PYTHON:-python}
mkdir -p "$OUT/results"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MOE_FT_GPU_RESULTS="$OUT/results"
# the node-local store wants a tmpfs; a container's /dev/shm is often tiny (64 MiB): fall back to /tmp
SHM_FREE_GB=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
STORE=/tmp
if [ "${SHM_FREE_GB:-0}" -ge 24 ]; then STORE=/dev/shm; fi
echo "store root: $STORE (/dev/shm free: ${SHM_FREE_GB:-?} GB)" | tee "$OUT/suite.log"
# moe-ft's C extension (host mfh64 sums; setup.py builds it at install): a copied tree has none, build it in place
# for this Python when a C compiler and its headers are there; without it the host sums run on NumPy
if ! $PY -c "import moe_ft.store._mfh64" 2>/dev/null; then
  $PY setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1
  echo "C extension built in place: rc=$? (see build_ext.log)" | tee -a "$OUT/suite.log"
fi

stage() {  # stage NAME OUTFILE CMD...
  local name=$1 file=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  local t0=$SECONDS
  "$@" > "$OUT/$file" 2> "$OUT/${file%.*}.err"
  echo "$name rc=$? $((SECONDS - t0)) s" | tee -a "$OUT/suite.log"
}

stage snapshot gpu_snapshot.json $PY -m tools.bench.gpu_snapshot --store-root "$STORE"
stage hash gpu_hash.json $PY -m tools.bench.gpu_hash
stage dispatch gpu_dispatch.json $PY -m tools.bench.gpu_dispatch
stage units units.log $PY -m pytest -q -p no:cacheprovider -rs -s --basetemp="$STORE/pt-gpu-units" \
  -m gpu tests/gpu tests/test_popularity.py tests/test_entry_hash.py --ignore=tests/gpu/test_gpu_recovery.py
stage recovery recovery.log $PY -m pytest -q -p no:cacheprovider -rs -s --basetemp="$STORE/pt-gpu-recovery" \
  tests/gpu/test_gpu_recovery.py
# half the rate of the default snapshot path, a copy into the arena (SNAPSHOT_BW overrides; 2e9 without a
# snapshot stage); each sparse window on both paths (arena, staged), alternating, twice
BW=${SNAPSHOT_BW:-$($PY -c "import json,sys; print(0.5e9 * json.load(open(sys.argv[1]))['mapped']['engine_gbps'])" \
  "$OUT/gpu_snapshot.json" 2>/dev/null || echo 2e9)}
stage overhead gpu_overhead.json $PY -m tools.bench.gpu_overhead --store-root "$STORE" --log-dir "$OUT" \
  --snapshot-bandwidth "$BW" --windows 8 0 --staged --repeats 2
stage interleave gpu_interleave.json $PY -m tools.bench.gpu_overhead --store-root "$STORE" --log-dir "$OUT/interleave" \
  --iters 160 --warmup 64 --windows 8 --interleave 8 --profile-worker 3 --gil-probe
stage interleave gpu_blocks.json $PY -m tools.bench.gpu_overhead --store-root "$STORE" --log-dir "$OUT/blocks" \
  --iters 96 --warmup 32 --windows 8 --interleave 8 --trace-blocks 3 --skip-none
stage pace gpu_copy_queue.json $PY -m tools.bench.gpu_copy_queue
stage pace gpu_paced.json $PY -m tools.bench.gpu_overhead --store-root "$STORE" --log-dir "$OUT/paced" \
  --iters 160 --warmup 64 --windows 8 --interleave 8 --paced 16 --kernel-copy 16 --skip-none --gil-probe
stage steps gpu_steps.json $PY -m tools.bench.gpu_overhead --store-root "$STORE" --log-dir "$OUT/steps" \
  --iters 160 --warmup 64 --windows 8 --interleave 8 --steps copy hash --skip-none --gil-probe
# decide: whether the kernel's copy becomes the default -- the engine's GPU tests with it, then the one DMA copy
# and the kernel's copy in launches of twice the blocks, then the kernel's copy with a shorter GIL switch interval
stage decide mapped.log $PY -m pytest -q -p no:cacheprovider -rs -s --basetemp="$STORE/pt-gpu-decide" \
  -m gpu tests/gpu/test_gpu_mapped.py
stage decide gpu_decide.json $PY -m tools.bench.gpu_overhead --store-root "$STORE" --log-dir "$OUT/decide" \
  --iters 320 --warmup 64 --windows 8 --interleave 8 --kernel-copy 16 --skip-none --gil-probe
stage decide gpu_switch.json $PY -m tools.bench.gpu_overhead --store-root "$STORE" --log-dir "$OUT/switch" \
  --iters 320 --warmup 64 --windows 8 --interleave 8 --kernel-copy 16 --skip-none --skip-default \
  --switch-interval 0.0005 --gil-probe
# agent: the mapped path's GPU tests first (the agent publishing the kernel's copies, bitwise, has not run on a
# device), then the kernel's copy with each point sealed and published by the trainer, then by the node agent
stage agent mapped_agent.log $PY -m pytest -q -p no:cacheprovider -rs -s --basetemp="$STORE/pt-gpu-agent" \
  -m gpu tests/gpu/test_gpu_mapped.py
# (--ft-publish-by agent), alternating in launches of 320 iterations; the hooks with the agent publishing (~7 min)
stage agent gpu_agent.json $PY -m tools.bench.gpu_overhead --store-root "$STORE" --log-dir "$OUT/agent" \
  --iters 320 --warmup 64 --windows 8 --interleave 8 --kernel-copy 16 --publish-agent --skip-none --skip-default \
  --gil-probe
stage agent ft_hooks_agent.json $PY -m tools.bench.ft_hooks --runs 1 --json \
  --extra "--ft-snapshot-copy-by kernel --ft-publish-by agent"
stage hooks ft_hooks.json $PY -m tools.bench.ft_hooks --runs 2 --json
stage hooks ft_hooks_kernel.json $PY -m tools.bench.ft_hooks --runs 2 --json --extra "--ft-snapshot-copy-by kernel"
stage cpubound cpu_bound.json env CUDA_VISIBLE_DEVICES= $PY tools/bench/ckpt_overhead.py --model medium --nproc 2 \
  --policies sparse --agent-hash --control --warmup-cycles 3 --cycles 10 --json
exit 0
