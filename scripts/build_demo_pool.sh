#!/usr/bin/env bash
# Rebuild data/demo_pool from Debian's opencv-doc video vtest.avi (not needed on a fresh clone:
# the pool is committed). Fetches the .deb without installing it system-wide.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download opencv-doc && dpkg -x opencv-doc_*.deb root)
video="$work/root/usr/share/doc/opencv-doc/examples/data/vtest.avi"
.venv/bin/rde pool build --video "$video" --out data/demo_pool
.venv/bin/rde clips build --video "$video" --out data/demo_clips
