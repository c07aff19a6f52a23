#!/usr/bin/env bash
# The GPU check of flowrl, on one GPU in at most ~9 minutes: the `gpu` test marker, then flowrl's own training loop on
# real-size networks of SD3.5-M, FLUX.1, Qwen-Image and Wan 2.1 (random weights: no hub) with flowrl plan's
# predictions beside the measured peaks. Every step runs under its own timeout and writes its results as it goes, so
# a step that fails (out of memory, a crash) leaves the others' numbers. Results: benchmarks/results/gpu/.
#   bash benchmarks/gpu_check.sh            # PY=python3 by default; set PY to another interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-python3}"
OUT=benchmarks/results/gpu
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
"$PY" - <<'PY' > "$OUT/environment.txt" 2>&1
import torch, platform
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for name in ("diffusers", "transformers", "peft", "accelerate", "flash_attn", "flash_attn_interface", "xformers"):
    try:
        print(name, __import__(name).__version__)
    except Exception as err:  # noqa: BLE001
        print(name, "missing:", type(err).__name__)
PY
cat "$OUT/environment.txt"

step() {  # step NAME SECONDS COMMAND...: one step under its timeout, its output kept, its exit status reported
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s (log: $OUT/$name.log)" | tee -a "$OUT/steps.txt"
  tail -n 25 "$OUT/$name.log"
}

: > "$OUT/steps.txt"
step gpu_tests 90 "$PY" -m pytest -m gpu tests/test_gpu.py tests/models/test_attention.py -q -p no:cacheprovider
for model in sd3 flux qwen_image wan; do
  case $model in  # small groups: one warm-up and one timed epoch each, in 80-150 s
    sd3) args="--group 16 --minibatch 4 --forward-batch 8"; limit=100 ;;
    flux) args="--group 8 --minibatch 2 --forward-batch 8"; limit=120 ;;
    qwen_image) args="--group 4 --minibatch 2 --forward-batch 4"; limit=150 ;;
    wan) args="--group 8 --minibatch 4 --forward-batch 8"; limit=80 ;;
  esac
  # shellcheck disable=SC2086
  step "bench_$model" "$limit" "$PY" benchmarks/gpu_bench.py --models "$model" --steps 10 --epochs 1 $args \
    --out "$OUT/bench_$model.json"
done
echo "done: $OUT/steps.txt"
