#!/usr/bin/env bash
# Headless Chromium screenshot of a running demo: apps/screenshot.sh [PORT] [OUTPUT_PNG]
# (defaults: 7860, docs/demo.png). Needs Debian's `chromium` package (apt-get install -y chromium).
# The flags keep Chromium offline and quiet: no first-run, sync, component updates or background fetches,
# a throwaway profile, and a virtual-time budget so the page's JavaScript finishes rendering before the shot.
set -euo pipefail
PORT="${1:-7860}"
OUT="${2:-docs/demo.png}"
PROFILE="$(mktemp -d)"
trap 'rm -rf "$PROFILE"' EXIT
mkdir -p "$(dirname "$OUT")"
chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$PROFILE" --window-size=1280,900 \
    --virtual-time-budget=8000 --screenshot="$OUT" "http://127.0.0.1:${PORT}/"
test -s "$OUT"
