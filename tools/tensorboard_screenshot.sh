#!/usr/bin/env bash
# What a user sees in TensorBoard, as a browser renders it: screenshots of a run's pages (scalars,
# images, histograms, text) in headless Chromium, TensorBoard bound to 127.0.0.1 on a free port.
#
#   tools/tensorboard_screenshot.sh runs/quickstart/tensorboard [OUT_DIR]     # PNGs in OUT_DIR
#
# Needs Chromium (Debian: `apt-get install chromium`); MOE_RL_VENV (default: the checkout's .venv)
# provides TensorBoard.
set -euo pipefail
LOGDIR=${1:?usage: tools/tensorboard_screenshot.sh LOGDIR [OUT_DIR]}
OUT=${2:-tensorboard_screenshots}
REPO=$(cd "$(dirname "$0")/.." && pwd)
VENV=${MOE_RL_VENV:-$REPO/.venv}
BROWSER=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
[ -n "$BROWSER" ] || { echo "tensorboard_screenshot: no Chromium on PATH (Debian: apt-get install chromium)" >&2; exit 2; }
[ -d "$LOGDIR" ] || { echo "tensorboard_screenshot: $LOGDIR is not a directory" >&2; exit 2; }
mkdir -p "$OUT"
PORT=$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
PROFILE=$(mktemp -d)
"$VENV/bin/tensorboard" --logdir "$LOGDIR" --host 127.0.0.1 --port "$PORT" > "$OUT/tensorboard.log" 2>&1 &
TB=$!
trap 'kill $TB 2>/dev/null; rm -rf "$PROFILE"' EXIT
for _ in $(seq 60); do
  "$VENV/bin/python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/data/runs', timeout=2)" \
    2>/dev/null && break
  sleep 1
done
for page in scalars images histograms text; do
  # no background networking: the machine may have no route out, and Chromium would keep trying
  "$BROWSER" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$PROFILE" --hide-scrollbars --window-size=1600,1100 \
    --virtual-time-budget=20000 --screenshot="$OUT/$page.png" "http://127.0.0.1:$PORT/#$page" > /dev/null 2>&1
  echo "$OUT/$page.png"
done
