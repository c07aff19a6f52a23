#!/usr/bin/env bash
# The GPU check of flowrl, on one GPU in at most ~9 minutes: the `gpu` test marker, then flowrl's own training loop on
# real-size networks of SD3.5-M, FLUX.1, Qwen-Image and Wan 2.1 (random weights: no hub) with flowrl plan's
# predictions beside the measured peaks. Every step runs under its own timeout and writes its results as it goes, so
# a step that fails (out of memory, a crash) leaves the others' numbers. Results: benchmarks/results/gpu/.
# flowrl plan's predictions are CPU work (meta tensors, ~1.5 min for the four families): fill their cache on any machine
# first, so the GPU's minutes go to the GPU's work (a missing entry is planned on the GPU machine instead).
#   PLAN_ONLY=1 bash benchmarks/gpu_check.sh   # on a CPU machine: benchmarks/results/gpu/plans.json
#   bash benchmarks/gpu_check.sh               # PY=python3 by default; RESULTS=DIR for another results folder
#   RUNS="sd3_mb8 sd3_fast" TESTS=0 bash benchmarks/gpu_check.sh   # some runs only, no test marker
# The speed levers side by side on SD3.5-M (each its own run: memory and kernels of one do not reach the next):
# sd3_fast (LoRA weights in bf16, no gradient through CFG's unconditional branch), sd3_compile (regional
# torch.compile, with its ratio drift at the old weights), sd3_compile_fast (both).
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT="${RESULTS:-benchmarks/results/gpu}"  # where the logs and measurements go
PLANS=benchmarks/results/gpu/plans.json
mkdir -p "$OUT" "$(dirname "$PLANS")"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
[ -n "${PLAN_ONLY:-}" ] || "$PY" - <<'PY' > "$OUT/environment.txt" 2>&1
import torch, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("diffusers", "transformers", "peft", "accelerate", "flash_attn", "flash_attn_interface", "xformers"):
    try:
        print(name, __import__(name).__version__)
    except Exception as err:  # noqa: BLE001
        print(name, "missing:", type(err).__name__)
PY
[ -n "${PLAN_ONLY:-}" ] || cat "$OUT/environment.txt"

step() {  # step NAME SECONDS COMMAND...: one step under its timeout, its output kept, its exit status reported
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s (log: $OUT/$name.log)" | tee -a "$OUT/steps.txt"
  tail -n 25 "$OUT/$name.log"
}

[ -n "${PLAN_ONLY:-}" ] || : > "$OUT/steps.txt"
FAST="--set model.lora_dtype=bf16 --set sampling.uncond_grad=false"
[ -n "${PLAN_ONLY:-}" ] || [ "${TESTS:-1}" = 0 ] || step gpu_tests 80 "$PY" -m pytest -m gpu tests/test_gpu.py tests/models/test_attention.py -q \
  -p no:cacheprovider
for run in ${RUNS:-sd3 flux qwen_image wan sd3_mb8}; do
  case $run in  # small groups: one warm-up and one timed epoch each, in 70-130 s
    sd3) model=sd3 args="--group 16 --minibatch 4 --forward-batch 8"; limit=90 ;;
    flux) model=flux args="--group 8 --minibatch 2 --forward-batch 8"; limit=110 ;;
    qwen_image) model=qwen_image args="--group 4 --minibatch 2 --forward-batch 4"; limit=130 ;;
    wan) model=wan args="--group 8 --minibatch 4 --forward-batch 8"; limit=70 ;;
    # the recipes' way (rollout calls of the micro-batch's size: no re-scoring pass), then one profiled epoch
    sd3_mb8) model=sd3 args="--group 16 --minibatch 8 --forward-batch 8 --profile $OUT"; limit=150 ;;
    sd3_fast) model=sd3 args="--group 16 --minibatch 8 --forward-batch 8 $FAST"; limit=80 ;;
    sd3_compile) model=sd3 args="--group 16 --minibatch 8 --forward-batch 8 --compile --profile $OUT"; limit=220 ;;
    sd3_compile_fast) model=sd3 args="--group 16 --minibatch 8 --forward-batch 8 --compile $FAST"; limit=200 ;;
    *) echo "unknown run $run" >&2; exit 2 ;;
  esac
  if [ -n "${PLAN_ONLY:-}" ]; then
    # shellcheck disable=SC2086
    "$PY" benchmarks/gpu_bench.py --models "$model" --steps 10 --epochs 1 $args --plans "$PLANS" --plan-only || exit 1
    continue
  fi
  # shellcheck disable=SC2086
  step "bench_$run" "$limit" "$PY" benchmarks/gpu_bench.py --models "$model" --steps 10 --epochs 1 $args \
    --plans "$PLANS" --out "$OUT/bench_$run.json"
done
echo "done: $OUT/steps.txt"
