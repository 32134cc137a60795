#!/usr/bin/env bash
# Build (or reuse) the project's GPU environment on a Linux x86_64 machine with NVIDIA GPUs and the CUDA
# toolkit: torch (its CUDA build from PyPI), Transformer Engine with its PyTorch extension compiled here
# against that torch, vLLM, megatron-core, mbridge, Ray, and moe_rl itself (editable, extras gpu,dev,math).
# Every version comes from requirements/gpu-constraints.txt (pip -c); this script names none of its own.
# Idempotent: a stamp records the inputs; when they are unchanged it only prints the report line.
#
#   bash tools/setup_gpu_env.sh            # build or reuse MOE_RL_GPU_VENV, import everything, report
#   bash tools/setup_gpu_env.sh --dry-run  # print the checks and pip commands, run nothing (any machine)
#   bash tools/setup_gpu_env.sh --no-gpu   # build and import without a GPU (docker build); nvcc needed
#   bash tools/setup_gpu_env.sh --report   # the import check and the report line only
#
# Needs: python3.12 with its venv module and headers (Debian/Ubuntu: python3.12-venv python3.12-dev),
# a C++ compiler, nvcc of the CUDA major in the constraints' `cuda:` line, cuDNN's headers (or the cuDNN
# wheel torch brings), network access to PyPI. Transformer Engine's extension takes minutes to compile
# (MAX_JOBS bounds the parallel compile jobs; default: all cores).
# Environment: MOE_RL_GPU_VENV [.venv-gpu], PYTHON [python3.12], MAX_JOBS, CUDA_HOME, CUDNN_PATH.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${MOE_RL_GPU_VENV:-.venv-gpu}
PY=${PYTHON:-python3.12}
CONSTRAINTS=requirements/gpu-constraints.txt
EXTRAS=gpu,dev,math
# what compiling Transformer Engine's PyTorch extension with --no-build-isolation imports (its setup.py
# imports torch, wheel and packaging; torch's cpp_extension uses ninja when present)
BUILD_DEPS=(setuptools wheel packaging ninja pybind11)

mode=build
case "${1:-}" in
  "") ;;
  --dry-run) mode=dry ;;
  --no-gpu) mode=nogpu ;;
  --report) mode=report ;;
  -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
  *) echo "[setup-gpu] unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac

say() { echo "[setup-gpu] $*" >&2; }
fail() { echo "[setup-gpu] error: $*" >&2; exit 1; }
run() {  # a command; in a dry run, only printed ("+ ..." on stdout)
  if [ "$mode" = dry ]; then echo "+ $*"; else "$@"; fi
}

[ -f "$CONSTRAINTS" ] || fail "$CONSTRAINTS is missing"
# the CUDA release of torch's wheels, e.g. 13.0: TE's core wheel and the nvcc here must have its major
CUDA=$(sed -n 's/^# cuda: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' "$CONSTRAINTS" | head -n 1)
[ -n "$CUDA" ] || fail "$CONSTRAINTS has no '# cuda: MAJOR.MINOR' line"
CUDA_MAJOR=${CUDA%%.*}
# the extra spelled as TE declares it (core-cu13): pip before 23.3 does not match core_cu13 to it
TE="transformer-engine[core-cu${CUDA_MAJOR},pytorch]"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
stamp="$VENV/.moe_rl_gpu_setup"
want=$(cat pyproject.toml "$CONSTRAINTS" tools/setup_gpu_env.sh | sha256sum | cut -d' ' -f1)

report() {  # $1: gpu (import everything, list the GPUs: there must be one) or nogpu (an image build)
  MOE_RL_GPU_CHECK=$1 "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import os

import torch
import megatron.core  # noqa: F401
import mbridge  # noqa: F401
import ray  # noqa: F401
import transformer_engine.pytorch  # noqa: F401  (imports without a driver too)
import vllm  # noqa: F401
import moe_rl  # noqa: F401

if os.environ["MOE_RL_GPU_CHECK"] == "gpu":
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if not names:
        raise SystemExit(f"[setup-gpu] error: torch sees no GPU (is the driver new enough for CUDA "
                         f"{torch.version.cuda}? nvidia-smi shows the CUDA version it supports)")
    gpus = f"{len(names)} GPU(s): " + ", ".join(sorted({f"{n} x{names.count(n)}" for n in names}))
else:
    gpus = "GPUs not checked (built without one)"
packages = ["torch", "vllm", "transformer-engine", "transformer_engine_torch", "megatron-core", "mbridge",
            "transformers", "ray"]
versions = ", ".join(f"{p} {md.version(p)}" for p in packages)
print(f"[setup-gpu] {versions}; CUDA {torch.version.cuda}; {gpus}")
EOF
}

if [ "$mode" = report ]; then
  [ -x "$VENV/bin/python" ] || fail "$VENV does not exist: run bash tools/setup_gpu_env.sh first"
  report gpu || fail "$VENV: the check failed (see above)"
  exit 0
fi

if [ "$mode" != dry ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/moe-rl" ]; then
  say "$VENV is up to date"
  [ "$mode" = nogpu ] || report gpu || fail "$VENV: the check failed (see above)"
  exit 0
fi

# -- what the build needs, each missing piece a one-line error --------------------------------------
if [ "$mode" = dry ]; then
  echo "[setup-gpu] dry run: nothing is installed; constraints $CONSTRAINTS (CUDA $CUDA), venv $VENV"
  echo "check: $PY (3.11 to 3.14, with venv and Python.h), a C++ compiler, nvcc $CUDA_MAJOR.x, nvidia-smi"
else
  pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) \
    || fail "$PY does not run: install it (Ubuntu: python3.12 python3.12-venv python3.12-dev) or set PYTHON"
  case $pyver in 3.1[1-4]) ;; *) fail "$PY is Python $pyver: vLLM 0.32 needs 3.11 to 3.14 (set PYTHON)" ;; esac
  "$PY" -c 'import os, sysconfig; os.stat(os.path.join(sysconfig.get_paths()["include"], "Python.h"))' \
    2>/dev/null || fail "$PY has no headers (Python.h) to compile TE's extension with: install python3.12-dev"
  command -v "${CXX:-c++}" >/dev/null 2>&1 || fail "no C++ compiler (${CXX:-c++}): install build-essential"
  if [ -z "${CUDA_HOME:-}" ]; then  # the toolkit of the nvcc on PATH, else /usr/local/cuda
    nvcc_bin=$(readlink -f "$(command -v nvcc || echo /nonexistent/bin/nvcc)")
    for c in "$(dirname "$(dirname "$nvcc_bin")")" /usr/local/cuda; do
      [ -x "$c/bin/nvcc" ] && [ -f "$c/include/cuda.h" ] && { CUDA_HOME=$c; break; }
    done
    [ -n "${CUDA_HOME:-}" ] || fail "no CUDA $CUDA_MAJOR.x toolkit (nvcc, cuda.h): install it, or set CUDA_HOME"
  fi
  export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
  [ -x "$CUDA_HOME/bin/nvcc" ] || fail "no nvcc in CUDA_HOME=$CUDA_HOME"
  nvcc_release=$("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
  [ "${nvcc_release%%.*}" = "$CUDA_MAJOR" ] \
    || fail "nvcc is CUDA $nvcc_release, torch's wheels CUDA $CUDA ($CONSTRAINTS): use a $CUDA_MAJOR.x toolkit"
  if [ "$mode" = build ]; then
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
      || fail "nvidia-smi finds no GPU (no driver here?); for an image build without one, use --no-gpu"
  fi
fi

start=$SECONDS
[ "$mode" = dry ] || say "building $VENV from $CONSTRAINTS (Transformer Engine compiles for minutes)"
[ -x "$VENV/bin/python" ] || run "$PY" -m venv "$VENV"
# torch first: Transformer Engine's extension compiles against the torch that is installed
run "${pip[@]}" install -q -c "$CONSTRAINTS" torch
run "${pip[@]}" install -q -c "$CONSTRAINTS" "${BUILD_DEPS[@]}"

# Headers: the toolkit's come first (-I $CUDA_HOME/include); those of the CUDA wheels torch brought
# (nvidia/*/include: cuDNN, cuSPARSE, cuBLAS, NCCL) fill in, through CPATH, what a minimal toolkit lacks
if [ "$mode" = dry ]; then
  echo "+ (CPATH: CUDNN_PATH/include, then the include directories of the CUDA wheels torch installed)"
else
  wheel_include=$("$VENV/bin/python" -c 'import glob, os, sysconfig
print(":".join(sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "include")))))')
  export CPATH="${CUDNN_PATH:+$CUDNN_PATH/include:}${CPATH:+$CPATH:}$wheel_include"
  for h in cudnn.h cusparse.h cublasLt.h; do
    found=""
    IFS=: read -r -a dirs <<< "$CUDA_HOME/include:$CPATH:/usr/include:/usr/include/x86_64-linux-gnu"
    for d in "${dirs[@]}"; do [ -n "$d" ] && [ -f "$d/$h" ] && { found=$d; break; }; done
    [ -n "$found" ] || fail "$h not found (toolkit, CUDNN_PATH, torch's CUDA wheels): install its headers"
  done
fi

[ "$mode" = dry ] || say "torch ready ($((SECONDS - start)) s); compiling Transformer Engine's PyTorch extension"
# NVTE_PYTORCH_FORCE_BUILD: compile here rather than fetch a prebuilt extension from GitHub
run env NVTE_PYTORCH_FORCE_BUILD="${NVTE_PYTORCH_FORCE_BUILD:-TRUE}" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  "${pip[@]}" install -q --no-build-isolation -c "$CONSTRAINTS" "$TE"
[ "$mode" = dry ] || say "Transformer Engine ready ($((SECONDS - start)) s); installing moe_rl[$EXTRAS]"
run "${pip[@]}" install -q -c "$CONSTRAINTS" -e ".[$EXTRAS]"

if [ "$mode" = dry ]; then
  echo "+ (imports torch, megatron.core, mbridge, ray, moe_rl, transformer_engine.pytorch, vllm; a report line)"
  exit 0
fi
check=gpu
[ "$mode" = nogpu ] && check=nogpu
report "$check" || fail "the environment does not import; see the output above"
echo "$want" > "$stamp"
say "done in $((SECONDS - start)) s"
