#!/usr/bin/env bash
# A prepared check of the Megatron trainer on one GPU: the local layer spec in bf16 and fp32, ranks
# started by run_ranks, no vLLM, Transformer Engine or Ray. For a lent GPU machine with python3, torch,
# transformers and pytest but neither megatron-core nor mbridge and no network: those two travel as
# wheels in .whl/ (git-ignored), which the dry run fetches.
#
#   bash tools/gpu_check.sh --dry-run   # here and in CI: fetch .whl, check what travels; no GPU
#   bash tools/gpu_check.sh             # on the GPU machine, from a checkout with .whl carried
#
# The GPU run installs the wheels into /tmp/site, prints the versions, runs the gpu tests of
# tests/train/test_gpu_local.py, then tools/gpu_check.py (one JSON line of figures), in at most about
# 8 minutes. With $OUT set, $OUT/gpu_check.log gets the whole output and $OUT/gpu_check.json the figures.
set -uo pipefail
cd "$(dirname "$0")/.."

# pyproject.toml's floors: what the CPU suite runs (megatron-core's last release for its Python 3.11)
WHEELS=(megatron-core==0.16.1 mbridge==0.15.1)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# -o timeout: pytest-timeout's limit per test (seconds); an unknown option, and harmless, without it
TESTS=(-m pytest -m gpu -q -s -o timeout=180 tests/train/test_gpu_local.py)
TESTS_LIMIT=240    # seconds for all the tests
MEASURE_LIMIT=210  # seconds for tools/gpu_check.py

plan() {
  local verb=$1
  echo "$verb install: .whl/*.whl into /tmp/site, then PYTHONPATH=/tmp/site:\$PWD"
  echo "$verb print: the versions of torch, CUDA, the GPU, megatron-core and mbridge"
  echo "$verb run: timeout ${TESTS_LIMIT}s python3 ${TESTS[*]}"
  echo "$verb run: timeout ${MEASURE_LIMIT}s python3 tools/gpu_check.py (one JSON line; with \$OUT, also \$OUT/gpu_check.json)"
}

fetch_wheels() {  # python: the wheels of WHEELS that .whl lacks, from PyPI
  local py=$1 pin name
  mkdir -p .whl
  for pin in "${WHEELS[@]}"; do
    name=${pin%%==*}
    compgen -G ".whl/${name//-/_}-${pin#*==}-*.whl" >/dev/null && continue
    echo "fetching $pin into .whl"
    "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp "${PLATFORMS[@]}" -d .whl "$pin" \
      || { echo "gpu_check: problem: could not download $pin into .whl (pip's message above)"; return 1; }
  done
}

dry_run() {
  local py=${PYTHON:-.venv/bin/python} start=$SECONDS problems=0 out count
  [ -x "$py" ] || py=python3
  "$py" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))' \
    moe_rl megatron mbridge packaging pytest 2>/dev/null \
    || { echo "gpu_check: the dry run needs the project's environment (make setup); $py lacks it"; return 1; }
  echo "gpu_check: dry run with $py (nothing runs on a GPU)"
  plan "would"
  fetch_wheels "$py" || problems=$((problems + 1))
  # from here on, as on the GPU machine: no vLLM, Transformer Engine, apex or Ray
  export PYTHONPATH="$PWD/tools/gpu_absent:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$py" tools/gpu_carry.py .whl "${WHEELS[@]}" || problems=$((problems + 1))
  out=$("$py" "${TESTS[@]}" --collect-only 2>&1)
  count=$(grep -c '^tests/train/test_gpu_local.py::' <<<"$out")
  if [ "$count" -gt 0 ]; then
    echo "collects: $count gpu tests in tests/train/test_gpu_local.py"
  else
    echo "$out" | tail -20
    echo "gpu_check: problem: tests/train/test_gpu_local.py collects no gpu test (pytest's output above)"
    problems=$((problems + 1))
  fi
  echo "measurement plan (tools/gpu_check.py):"
  "$py" tools/gpu_check.py --dry-run || problems=$((problems + 1))
  if [ "$problems" -gt 0 ]; then
    echo "gpu_check: dry run failed: $problems step(s) with problems (lines above)"
    return 1
  fi
  echo "gpu_check: dry run OK in $((SECONDS - start)) s"
}

gpu_run() {
  local failed=0 rc raw json=${OUT:-/tmp}/gpu_check.json
  compgen -G ".whl/*.whl" >/dev/null \
    || { echo "gpu_check: no wheels in .whl: run 'bash tools/gpu_check.sh --dry-run' where pip works, and carry .whl"; return 1; }
  plan "will"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: could not install the wheels of .whl into /tmp/site (pip's message above)"; return 1; }
  export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
  python3 - <<'EOF' || { echo "gpu_check: python3 cannot import torch or read the installed versions"; return 1; }
import torch
from importlib.metadata import version
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}, "
      f"megatron-core {version('megatron-core')}, mbridge {version('mbridge')}")
EOF
  echo "== gpu tests"
  timeout "$TESTS_LIMIT" python3 "${TESTS[@]}" || { echo "gpu_check: the gpu tests failed or ran out of time (exit $?)"; failed=1; }
  echo "== measurement"
  raw=$(mktemp)
  timeout "$MEASURE_LIMIT" python3 tools/gpu_check.py | tee "$raw"
  rc=${PIPESTATUS[0]}
  grep '^{' "$raw" | tail -1 > "$json"
  if [ "$rc" -ne 0 ] || [ ! -s "$json" ]; then
    echo "gpu_check: the measurement failed or ran out of time (exit $rc; its output above)"
    failed=1
  fi
  return "$failed"
}

main() {
  case "${1:-}" in
    --dry-run) dry_run ;;
    "") gpu_run ;;
    *) echo "usage: bash tools/gpu_check.sh [--dry-run]"; return 2 ;;
  esac
}

if [ -n "${OUT:-}" ]; then
  main "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
main "$@"
