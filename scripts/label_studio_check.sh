#!/usr/bin/env bash
# The Label Studio round trip (tests/test_label_studio.py): a real Label Studio server on loopback,
# a project made from the demo benchmark's review folder, annotations through label-studio-sdk, the
# export imported by `rde labels import`. Label Studio pins its own Django stack and numpy, so it
# lives in a separate venv (.rde/label-studio-venv). CI runs this after `make test` (`.ci/run`); it
# prints how long the install took, and the test prints how long the server took to start.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.rde/label-studio-venv
if [ ! -x "$venv/bin/label-studio" ]; then
  started=$(date +%s)
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "label-studio==1.23.2"
  echo "label-studio venv installed in $(( $(date +%s) - started )) s"
fi
RDE_LABEL_STUDIO_PYTHON="$PWD/$venv/bin/python" .venv/bin/pytest -q -s -m label_studio tests/test_label_studio.py
