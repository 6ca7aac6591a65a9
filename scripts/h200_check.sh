#!/usr/bin/env bash
# Everything the H200 has to confirm, in one device call, results under $1 (8 files at most, the device tool's limit):
# kernels compiled in parallel first, then `pytest -m gpu`, the benchmarks against nemo-automodel's
# built-in kernels, and short CUDA training runs in both scoring modes.
#   source .device/env.sh; bash scripts/h200_check.sh "$OUT"
# With two GPUs, add `cp` as a second argument for the NCCL context-parallel test and benchmark;
# `step` as the second argument ends with the V4 and V4.1 model steps at S=16,384 instead, `long`
# with V4 steps under the plugin's recompute up to S=131,072 (docs/performance.md v17).
set -uo pipefail
out=${1:?usage: h200_check.sh OUT_DIR [cp|step|long]}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() { echo "== $* ($(date +%T))"; }

step precompile
python3 scripts/precompile_kernels.py --workers 16 --heads 8 16 32 64 128 --dims 64 128 --counts 64 100 512 1024 2048 \
  >"$out/precompile.txt" 2>&1 || tail -5 "$out/precompile.txt"

step "pytest -m gpu (three groups at once: kernel compiles take the CPUs, the tests are short)"
pytest_gpu=(python3 -m pytest -m gpu -q -p no:cacheprovider -rfE --durations=5)
indexers=(tests/ops/test_v4_kernels_gpu.py tests/ops/test_v41_kernels_gpu.py tests/layers/test_v41_layer_gpu.py)
"${pytest_gpu[@]}" tests/ops/test_topk_kernels_gpu.py >"$out/gpu_topk.part" 2>&1 &
"${pytest_gpu[@]}" "${indexers[@]}" >"$out/gpu_indexers.part" 2>&1 &
# test_automodel_integration.py holds no GPU test and needs `datasets`, which the main bundle lacks.
"${pytest_gpu[@]}" tests --ignore=tests/ops/test_topk_kernels_gpu.py --ignore=tests/integrations/test_automodel_integration.py "${indexers[@]/#/--ignore=}" >"$out/gpu_rest.part" 2>&1 &
wait
cat "$out"/gpu_*.part >"$out/gpu_tests.txt" && rm -f "$out"/gpu_*.part
grep -E "passed|failed|FAILED|ERROR" "$out/gpu_tests.txt" | tail -15

step "memcheck: the radix select on long rows (compute-sanitizer; its bound checks are off by design)"
compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_topk_kernels_gpu.py \
  -k "(on_ranges and special and 512-20001) or (block_masked and special and 512-20001)" 2>&1 | tail -2

step "indexer benchmark"
python3 examples/benchmark_indexer.py --out "$out/bench_indexer.json" 2>&1 | grep -v INFO | tail -40

step "LM head benchmark (fp32 head of bf16 activations)"
python3 examples/benchmark_lm_head.py --json "$out/bench_lm_head.json" 2>&1 | grep -v INFO | tail -6

step "stage timings"
python3 examples/benchmark_parts.py 2>&1 | grep -v INFO | tee "$out/parts.txt"

step "selection benchmark"
python3 examples/benchmark_selection.py --check --out "$out/bench_selection.json" 2>&1 | grep -v INFO | tail -20

step "CUDA training runs"
for scoring in v4 v41; do
  python3 -m nemo_dsa.train device=cuda model=small recipe=h200 scoring=$scoring \
    recipe.max_steps=30 recipe.val_every=15 run_dir=/tmp/h200_$scoring resume=never recipe.progress_bar=false 2>&1 | grep -v INFO | tail -3
  sed "s/^/{\"scoring\": \"$scoring\", \"record\": /; s/\$/}/" "/tmp/h200_$scoring/metrics.jsonl" >>"$out/train.jsonl"
done

if [ "${2:-}" = cp ]; then
  step "context parallelism over NCCL"
  python3 -m pytest -q -p no:cacheprovider tests/models/test_cp_gpu.py 2>&1 | tail -5
  python3 -m torch.distributed.run --standalone --nproc-per-node 2 examples/benchmark_cp.py \
    --seq-len 65536 --out "$out/bench_cp.json" 2>&1 | grep -v INFO | tail -10
fi

if [ "${2:-}" = step ]; then
  step "model steps at S=16,384: the plugins against the built-in models"
  for family in v4 v41; do
    python3 examples/benchmark_model_step.py --family $family --seq 16384 --out "/tmp/step_$family.json" 2>&1 | grep -v INFO | tail -6
  done
  cat /tmp/step_v4.json /tmp/step_v41.json >"$out/steps.txt"  # the two JSON documents in one file (8 come back)
fi

if [ "${2:-}" = long ]; then
  step "V4 long sequences: the plugin's recompute (hyper-connections, norms), alone and with checkpointed blocks"
  lean=(--recompute hyper_connections,norms)
  python3 examples/benchmark_model_step.py --family v4 --seq 16384 65536 --sides plugin "${lean[@]}" \
    --steps 3 --warmup 1 --out /tmp/step_lean.json 2>&1 | grep -v INFO | tail -4
  python3 examples/benchmark_model_step.py --family v4 --seq 131072 --sides plugin "${lean[@]}" --activation-checkpointing full \
    --steps 2 --warmup 1 --out /tmp/step_131k.json 2>&1 | grep -v INFO | tail -3
  python3 examples/benchmark_model_step.py --family v4 --seq 65536 "${lean[@]}" --activation-checkpointing selective \
    --steps 3 --warmup 1 --out /tmp/step_selective.json 2>&1 | grep -v INFO | tail -3
  python3 examples/benchmark_model_step.py --family v4 --seq 16384 131072 --sides plugin --recompute hyper_connections,norms,attention \
    --steps 2 --warmup 1 --out /tmp/step_attention.json 2>&1 | grep -v INFO | tail -4
  cat /tmp/step_lean.json /tmp/step_131k.json /tmp/step_selective.json /tmp/step_attention.json >"$out/steps_long.txt"
fi
