#!/usr/bin/env bash
# Checks nemo_dsa on a Hopper GPU (H100 or H200) and measures it against nemo-automodel's built-in
# kernels: the kernels compiled in parallel, `pytest -m gpu` (every kernel against its torch
# reference), the op benchmarks under benchmarks/, and short CUDA training runs in both scoring modes.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--steps] [--cp]
#
# OUT_DIR (default ./gpu_check_results) receives one log per stage and the benchmarks' JSON;
# a table of the stages (status, minutes, where the output is) is printed at the end and kept as
# OUT_DIR/summary.txt. --steps adds the whole training steps of the V4 and V4.1 step models at
# S=16,384 against the built-in models (about 10 minutes); --cp the context-parallel test and
# benchmark over NCCL (two GPUs). PYTHON picks the interpreter (default: python3).
# Exit status: 0 when every stage passed, 1 otherwise. Compiled kernels stay in TileLang's cache
# (TILELANG_CACHE_DIR), so a second run starts measuring at once.
set -uo pipefail

usage() { echo "usage: gpu_check.sh [OUT_DIR] [--steps] [--cp]" >&2; exit 2; }
out=./gpu_check_results steps=0 cp=0 named_out=0
for arg in "$@"; do
  case "$arg" in
    --steps) steps=1 ;;
    --cp) cp=1 ;;
    -h|--help) usage ;;
    -*) echo "gpu_check.sh: unknown option $arg" >&2; usage ;;
    *) [ "$named_out" = 0 ] || usage; out=$arg named_out=1 ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
py=${PYTHON:-python3}
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0) else 1)"; then
  echo "gpu_check.sh: needs a CUDA GPU of compute capability 9.0 (Hopper) visible to $py" >&2
  exit 2
fi
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
summary=()
failed=0

# run NAME LOG COMMAND...: one stage, its output in OUT_DIR/LOG, a line in the table.
run() {
  local name=$1 log=$2 start status
  shift 2
  start=$(date +%s)
  echo "== $name ($(date +%T))"
  "$@" >"$out/$log" 2>&1
  status=$?
  local minutes
  minutes=$(awk -v s="$(( $(date +%s) - start ))" 'BEGIN { printf "%.1f", s / 60 }')
  if [ "$status" = 0 ]; then
    summary+=("$(printf '%-34s %-6s %6s  %s' "$name" ok "$minutes" "$log")")
  else
    failed=1
    summary+=("$(printf '%-34s %-6s %6s  %s' "$name" "rc=$status" "$minutes" "$log")")
    tail -5 "$out/$log"
  fi
}

workers=$(nproc)
run "compile the kernels" precompile.txt \
  "$py" scripts/precompile_kernels.py --workers "$workers" --heads 8 16 32 64 128 --dims 64 128 \
  --counts 64 100 512 1024 2048
# The CP test needs two GPUs and has its own stage below.
run "pytest -m gpu" gpu_tests.txt \
  "$py" -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=10 tests --ignore=tests/models/test_cp_gpu.py
grep -E "passed|failed|error" "$out/gpu_tests.txt" | tail -1
run "attention op vs built-in" attention.txt "$py" benchmarks/attention.py --json "$out/attention.json"
run "indexers vs built-in" indexer.txt "$py" benchmarks/indexer.py --out "$out/indexer.json"
run "selection (streamed, checked)" selection.txt "$py" benchmarks/selection.py --check --out "$out/selection.json"
run "V4.1 selection (streamed, checked)" selection_v41.txt \
  "$py" benchmarks/selection.py --shapes v41 --sizes 32768 --check --out "$out/selection_v41.json"
run "stages alone" parts.txt "$py" benchmarks/parts.py
run "fp32 LM head vs built-in" lm_head.txt "$py" benchmarks/lm_head.py --json "$out/lm_head.json"
for scoring in v4 v41; do
  run "train 30 steps, scoring=$scoring" "train_$scoring.txt" \
    "$py" -m nemo_dsa.train device=cuda model=small recipe=h200 scoring=$scoring recipe.max_steps=30 \
    recipe.val_every=15 "run_dir=$out/train_$scoring" resume=never recipe.progress_bar=false
done
if [ "$steps" = 1 ]; then
  for family in v4 v41; do
    run "$family model step vs built-in" "step_$family.txt" \
      "$py" benchmarks/model_step.py --family "$family" --seq 16384 --out "$out/step_$family.json"
  done
fi
if [ "$cp" = 1 ]; then
  run "context parallel (NCCL) test" cp_test.txt "$py" -m pytest -q -p no:cacheprovider tests/models/test_cp_gpu.py
  run "context parallel benchmark" cp_bench.txt \
    "$py" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/context_parallel.py \
    --seq-len 65536 --out "$out/context_parallel.json"
fi

{
  echo
  "$py" -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  printf '%-34s %-6s %6s  %s\n' stage status min output
  printf '%s\n' "${summary[@]}"
  echo "results: $out"
} | tee "$out/summary.txt"
exit "$failed"
