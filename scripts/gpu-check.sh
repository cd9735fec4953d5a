#!/usr/bin/env bash
# The GPU path, end to end, on a machine with an NVIDIA GPU, in under 10 minutes: install the `gpu`
# extra, build a random-weight Llama-shaped model big enough to load the GPU (no hub), write a
# cluster config for it (two vLLM replicas on the GPU when memory allows), check it, and run the
# overhead benchmark's vLLM phase (ours vs vllm-router over the same engines) and an affinity
# comparison (cache-aware vs round robin on a shared-prefix workload), writing
# loadtest/results/gpu_*.json. Record what you saw in BENCHMARKS.md.
#
#   scripts/gpu-check.sh [--dry-run] [--budget-s 600]
#
# --dry-run: everything up to the point where a GPU is needed, on any machine (CI tests it on
# CPU): no install (the existing venv), the tiny model in place of the big one, an assumed 141 GiB
# GPU; the config is written and checked, the variants file written, and the benchmark commands
# printed instead of run.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
budget=600
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --budget-s) budget="$2"; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
venv="${LLMC_VENV:-.venv}"
py="$venv/bin/python"
work="${LLMC_GPU_CHECK_DIR:-$(mktemp -d -t llmc-gpu-check-XXXX)}"
results="${LLMC_GPU_CHECK_RESULTS:-loadtest/results}"
mkdir -p "$work" "$results"
started=$SECONDS

say() { echo "[gpu-check $((SECONDS - started))s] $*"; }
left() { echo $((budget - (SECONDS - started))); }
# run "what" command...: a step bounded by what is left of the budget; its output in $work/log.
run() {
  local what="$1"
  shift
  local limit
  limit="$(left)"
  if [ "$limit" -le 0 ]; then say "out of time before: $what"; exit 124; fi
  say "$what (at most ${limit}s)"
  timeout --kill-after=20 "$limit" "$@" >>"$work/log" 2>&1 || {
    local rc=$?
    say "failed ($rc): $what; the end of $work/log:"
    tail -n 40 "$work/log" | sed 's/^/    /' >&2
    exit "$rc"
  }
}

if [ "$dry" = 1 ]; then
  gib=141
  shape=tiny
  [ -x "$py" ] || { echo "gpu-check --dry-run: no $py (run scripts/setup.sh first)" >&2; exit 1; }
  say "dry run: no GPU needed; assuming a ${gib} GiB GPU and the tiny model"
else
  gib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0 2>/dev/null | head -1 || true)"
  [ -n "$gib" ] || { echo "gpu-check: no NVIDIA GPU visible (nvidia-smi); try --dry-run" >&2; exit 1; }
  gib=$((gib / 1024))
  shape=gpu-1b
  say "GPU 0: ${gib} GiB ($(nvidia-smi --query-gpu=name --format=csv,noheader -i 0 | head -1))"
  run "installing the gpu extra (scripts/setup.sh gpu)" bash scripts/setup.sh gpu
fi

run "building the $shape random-weight Llama" "$py" -m cluster.engine.tiny_model --shape "$shape" --quiet
model="$("$py" -m cluster.engine.tiny_model --shape "$shape")"
cfg="$work/gpu-check.yaml"
run "writing the cluster config for the GPU" "$py" -m loadtest.benchmarks.gpu_check config --model "$model" \
  --gpu-gib "$gib" --shape "$shape" --out "$cfg"
run "checking it" "$py" -m cluster check --config "$cfg"
say "$(awk '$1 == "replicas:" {print $2; exit}' "$cfg") vLLM replica(s) on the GPU: $cfg"
variants="$work/variants.yaml"
run "writing the affinity variants" "$py" -m loadtest.benchmarks.gpu_check variants --config "$cfg" --out "$variants"

overhead=("$py" -m loadtest.benchmarks.bench_overhead --vllm --quick --vllm-config "$cfg"
  --out "$results/gpu_overhead.json")
affinity=("$py" -m cluster bench --variants "$variants" --workload shared-prefix --rate 8
  --duration 45 --out-dir "$work" --tag gpu_affinity --fail-on-error)
if [ "$dry" = 1 ]; then
  say "would run: ${overhead[*]}"
  say "would run: ${affinity[*]}"
  say "dry run done: config and variants in $work"
  exit 0
fi
run "overhead benchmark, vLLM phase (ours vs vllm-router, same engines)" "${overhead[@]}"
run "affinity benchmark (cache_aware vs round_robin)" "${affinity[@]}"
cp "$work/bench-gpu_affinity.json" "$results/gpu_affinity.json"
cp "$work/bench-gpu_affinity.md" "$results/gpu_affinity.md"
say "done in $((SECONDS - started))s: $results/gpu_overhead.json, $results/gpu_affinity.json; logs in $work/log"
