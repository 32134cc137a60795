#!/usr/bin/env bash
# moe_rl on one machine: the run starts its own Ray (all CPUs and GPUs of this machine) and stops it
# at the end.
#
#   launch/local.sh configs/quickstart.yaml run.steps=50
#
# Knobs: MOE_RL_VENV (default: the checkout's .venv), OMP_NUM_THREADS (unset: each trainer rank and
# engine computes with its share of the cores, cluster.trainer_threads / engine_threads; set: at most
# that many threads each), MOE_RL_LOG (default runs/<time>.log; the console shows it too),
# MOE_RL_RETRIES (default 0: after a process died or hung, run again from the last checkpoint up to
# this many times; launch/retry.sh).
set -euo pipefail
CONFIG=${1:?usage: launch/local.sh CONFIG [section.key=value ...]}
shift
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${MOE_RL_VENV:-$REPO/.venv}
LOG=${MOE_RL_LOG:-$REPO/runs/$(date +%Y%m%d-%H%M%S).log}
[ -x "$VENV/bin/moe-rl" ] || { echo "launch/local.sh: no environment at $VENV (run: make setup)" >&2; exit 1; }
mkdir -p "$(dirname "$LOG")"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
cd "$REPO"
source "$REPO/launch/retry.sh"
for attempt in $(seq 0 "$RETRIES"); do
  echo "[launch/local] $VENV/bin/moe-rl train $CONFIG $* (log: $LOG)" | tee -a "$LOG"
  set +e
  "$VENV/bin/moe-rl" train "$CONFIG" "$@" 2>&1 | tee -a "$LOG"
  code=${PIPESTATUS[0]}
  set -e
  retryable "$code" && (( attempt < RETRIES )) || exit "$code"
  echo "[launch/local] the run stopped with exit code $code; retry $((attempt + 1)) of $RETRIES from its last checkpoint" | tee -a "$LOG"
done
