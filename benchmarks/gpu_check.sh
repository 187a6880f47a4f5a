#!/usr/bin/env bash
# The GPU check, for a bare, offline machine with CUDA GPUs: one run, about 6 minutes on one H200
# (the estimates below), under 9 min 20 s whatever happens (the budget), no downloads, no installs
# (the checkout goes on PYTHONPATH). It needs python with torch (CUDA), transformers,
# sentence-transformers, pyarrow, tokenizers, safetensors, click, rich and tqdm; not pytest, nvtx,
# flash-attn or any model files: every model is built from its config with random weights.
#   1. environment: versions, the driver (persistence mode, clocks), the C compiler and Python
#      headers Triton builds its launcher with, the tokenizer's parallelism (env.json);
#   2. checkpoints: all-MiniLM-L6-v2's shape (the checks), BERT-large and Qwen3-Embedding-0.6B's;
#   3. the GPU checks (tests/gpu_checks.py, also run by tests/gpu/test_gpu.py under pytest): CUDA equals
#      CPU, staging slots never written mid-copy, graphs equal eager and were really captured, the
#      half dtype close to float32, generation with and without decode graphs giving the CPU's
#      greedy tokens, the Triton paged kernel against the reference, the decode graphs' capture
#      window under the bound the KV pool leaves room for;
#   4. collectives: the tensor-parallel group's NCCL path at world size 1 (collectives.json);
#   5. multi-device and 6. tensor-parallel: every GPU against one, --tp 2 against --tp 1 (tp.json);
#      with one GPU each says 'skipped' in seconds;
#   7. paged attention: the Triton kernel against the torch path over context lengths, with each
#      one's share of the HBM bandwidth, and as a gpt-oss sliding layer (window 128, sinks)
#      (paged_attention.json);
#   8. generation (bench_generate.py): Llama-3.2-1B's shape with its 128,256-token vocabulary in
#      bfloat16, 512 prompts of 16-1024 tokens, up to 256 new tokens: hpcinfer's variants against
#      transformers' static batching and continuous batching; useful tokens/s, the GPU's busy
#      share, a decode probe's memory-bandwidth utilisation (generate.json);
#   9. benchmark / 10. benchmark-decoder (bench_embed.py): BERT-large and the 0.6B decoder
#      embedder, hpcinfer (1 and 2 streams) against sentence-transformers and the compute ceiling:
#      rows/s, compute utilisation against 989 TFLOP/s (bench.json, bench_decoder.json).
# Everything it measures lands in the output folder (--out DIR; default $OUT where the device tool
# sets it, else gpu_check-<UTC time>/): gpu_check.log (or --log PATH), the JSON files named above,
# and steps.json (each step's status, seconds, limit and estimate), rewritten as each step starts
# and ends and by the exit trap, whatever fails or kills the run. Each benchmark rewrites its own
# JSON after every measurement (temp + rename) and takes --deadline S: no new measurement starts S
# seconds into its step, so what it measured survives a step's time limit.
#
# Usage: bash benchmarks/gpu_check.sh [--dry-run] [--out DIR] [--log PATH] [PYTHON]
#   --dry-run   every step on the CPU at tiny sizes (the simulated asynchronous device for the GPU,
#               Triton's interpreter for its compiler, gloo for NCCL), so every code path runs; CI
#               runs it so this script cannot rot. It fails unless every step ran and passed.
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
    -h | --help) sed -n '2,38p' "$0"; exit 0 ;;
    *) PY="$1" ;;
  esac
  shift
done
PY=${PY:-$(command -v python || command -v python3)}
OUT_DIR=${OUT_DIR:-${OUT:-gpu_check-$(date -u +%Y%m%dT%H%M%SZ)}}
mkdir -p "$OUT_DIR" || exit 1
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG=${LOG:-$OUT_DIR/gpu_check.log}
# NOTE: tee ignores the signals that stop the run, so the exit trap's lines still reach the log;
# it ends when this shell closes its end of the pipe.
exec > >(trap '' INT TERM HUP; exec tee "$LOG") 2>&1
trap '' PIPE

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
# NOTE: the tokenizer's Rust thread pool stays on (TOKENIZERS_PARALLELISM=false would leave one core
# to tokenize a benchmark's corpus); the environment step records it. No step forks after
# tokenizing: the ranks of the multi-process steps are spawned.
unset TOKENIZERS_PARALLELISM
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")  # checkpoints and scratch: results go to $OUT_DIR

if [ "$DRY" = 1 ]; then
  # NOTE: no GPU: Triton kernels run in Triton's interpreter, chosen before anything imports Triton;
  # one torch thread a process: on CI's 2 shared cores, OpenMP barriers make two threads far slower
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
  # NOTE: the 540-560 s budget fits the device tool's 600 s a command; the dry run has no such cap and
  # runs on CI's 2 shared cores, which have taken 127 s to 400 s for the same steps: room to 30 minutes
  BUDGET=1800 GPUS=0 DEVICE=simulated BENCH_DEVICE=cpu
  MODELS=(minilm tiny-bert tiny-qwen3 --device cpu --dtype float32)
  CHECKS=(--rows 48 --max-length 32)
  COLLECTIVES=(--device cpu)
  MULTI=(--rows 100 --gen-rows 8 --dry-run)
  TP=(--device cpu --prompts 4)
  PAGED=(--device cpu --heads 4 --kv-heads 2 --head-dim 16 --peak-tbs 0.1 --window 24)
  GEN=(--device cpu --shape tiny-llama --prompts 8 --prompt-lengths 8,64 --new-tokens 4,16 --static-batches 8
       --kv-cache-memory 64MiB --probe 2,16,4 --lead 1 --peak-tbs 0.1
       --variants "attention=torch,graphs=1;attention=torch,graphs=0;attention=torch,graphs=1,kv=fp8,quantize=fp8")
  EMBED=(--rows 48 --tile 2 --st-batch-sizes 32 --peak-tflops 1)
  BERT=tiny-bert DECODER=tiny-qwen3 DECODER_COSINE=0.999
else
  BUDGET=560 DEVICE=cuda BENCH_DEVICE=cuda
  GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
  MODELS=(minilm bert-large qwen3-0.6b --device cuda --dtype bfloat16)
  CHECKS=(--rows 300 --max-length 128)
  COLLECTIVES=(--device cuda)
  MULTI=(--rows 3000)
  TP=(--device cuda --prompts 64)
  PAGED=(--device cuda --window 128)
  GEN=(--device cuda)
  EMBED=(--tile 5 --repeats 2 --st-batch-sizes 256)
  BERT=bert-large DECODER=qwen3-0.6b
  # NOTE: last-token pooling keeps one token's bfloat16 state (no mean over the row to average the
  # rounding out) after 28 layers in which hpcinfer and sentence-transformers pad on different sides
  DECODER_COSINE=0.995
fi

# Time on one H200 (141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16), by step: the estimate, its limit
# (a hang's cost) and its --deadline (no new measurement after it; the rest of the limit lets the
# running one finish). How each estimate was derived:
# - environment 10 s: importing torch, transformers and sentence-transformers (~6 s), nvidia-smi,
#   tokenizing 6,000 rows on 16 cores;
# - checkpoint 15 s: BERT-large's 335M normal draws on the CPU and 1.3 GB written; Qwen3's 0.6B drawn
#   on the GPU, 1.2 GB written at ~1 GB/s; MiniLM 0.5 s;
# - checks 60 s: eight checks at 300 rows of MiniLM (about 1-2 s an embedding run, model load
#   included), 3 x ~36 decode graphs captured at ~10 ms each, Triton compiled twice (bf16 and
#   float32, ~5 s each with its launcher built by the C compiler), a CUDA context and cuBLAS;
# - collectives 10 s: torch import, CUDA context, NCCL's communicator (~2-5 s), five 64 MiB ops;
# - multi-device and tensor-parallel 3 s each with one GPU (a python start and a device count);
#   with 2+ GPUs their limits grow to what they measure (~60 s each, from the dry run's work);
# - paged-attention 15 s: Triton's compile (cached on disk by the checks step), then per context
#   (256-16,384 keys, 64 sequences) 22 calls each way; the torch path's 16,384 moves ~20 GB a call
#   (K/V repeated to 32 heads in float32 by SDPA's math kernel) at ~3 TB/s: 0.15 s;
# - generation 150 s: the 1.24B model drawn on the GPU and 2.5 GB written and read back (~10 s);
#   per hpcinfer variant ~12 s: 72 decode graphs captured (~2 s), a warm-up (~1 s), the run
#   (124k prompt tokens at ~400 TFLOP/s: ~1 s; ~500 decode steps at ~4 ms: ~2 s; eager steps at
#   ~6 ms of launches, the torch path's ~18 ms of gathered, repeated K/V), the decode probe (~1 s);
#   5 variants ~60 s. transformers static batching, 2 batches of 256 padded to ~1024 tokens and
#   run 256 steps at ~35 ms (its cache concatenated and K/V repeated each step): ~20 s, with load,
#   warm-up and probe ~30 s; continuous batching: load and graph warm-up ~15 s, 70k tokens at an
#   assumed ~5,000 tokens/s ~14 s, probe ~4 s: ~35 s;
# - benchmark 55 s: 15,000 rows (1.4M real tokens, 0.61 GFLOP a token: 0.87 PFLOP) at ~350 TFLOP/s
#   is ~2.5 s a method; 4 methods x 2 rounds ~20 s, hpcinfer's model load each call ~8 s, set-ups
#   (2 hpcinfer warm-ups, sentence-transformers, the ceiling's tensors) ~15 s, imports ~6 s;
# - benchmark-decoder 55 s: 12,000 rows (1.1M tokens, 0.88 GFLOP a token), the same make-up.
# Sum of the estimates: 10+15+60+10+3+3+15+150+55+55 = 376 s, 6 min 16 s (under 8 minutes). The
# limits add up to more (750 s); the budget (560 s, under the device tool's 600 s a command) caps
# them: a step gets at most what is left, and none starts with under 10 s left.
if [ "$DRY" = 1 ]; then MULTI_LIMIT=40 TP_LIMIT=60  # two CPU replicas, two gloo ranks: the real paths
elif [ "$GPUS" -ge 2 ]; then MULTI_LIMIT=120 TP_LIMIT=150
else MULTI_LIMIT=20 TP_LIMIT=20; fi

T0=$SECONDS
STEPS=()  # "name status seconds limit estimate", for steps.json
CHILD=""
KILLED=""

write_steps() {  # steps.json from STEPS, atomically (a temp file, then a rename); $1: finished (true/false)
  local tmp="$OUT_DIR/.steps.json.$$" sep="" line name status secs limit est
  {
    printf '{"dry_run": %s, "finished": %s, "budget_s": %s, "elapsed_s": %s, "steps": [' \
      "$([ "$DRY" = 1 ] && echo true || echo false)" "$1" "$BUDGET" "$((SECONDS - T0))"
    for line in "${STEPS[@]}"; do
      read -r name status secs limit est <<<"$line"
      printf '%s\n {"step": "%s", "status": "%s", "seconds": %s, "limit_s": %s, "estimate_s": %s}' \
        "$sep" "$name" "$status" "$secs" "$limit" "$est"
      sep=","
    done
    printf '\n]}\n'
  } >"$tmp" && mv -f "$tmp" "$OUT_DIR/steps.json"
}

finish() {  # the exit trap: steps.json whatever happened, the scratch folder removed
  write_steps "$([ -z "$KILLED" ] && echo true || echo false)"
  rm -rf "$WORK"
}

on_signal() {  # stopped from outside: the running step's process group ends too, marked killed
  trap '' INT TERM HUP
  KILLED=$1
  local name status secs limit est
  if [ -n "$CHILD" ]; then
    kill -TERM -- "-$CHILD" 2>/dev/null || kill -TERM "$CHILD" 2>/dev/null
    local last=$((${#STEPS[@]} - 1))
    read -r name status secs limit est <<<"${STEPS[$last]}"
    STEPS[$last]="$name killed $((SECONDS - STEP_START)) $limit $est"
  fi
  echo "=== gpu_check: stopped by SIG$1 after $((SECONDS - T0)) s; results so far in $OUT_DIR"
  exit 143
}
trap finish EXIT
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap 'on_signal HUP' HUP

step() {  # step NAME ESTIMATE_S LIMIT_S DEADLINE_S|- COMMAND...: runs it, records it in steps.json
  local name=$1 estimate=$2 limit=$3 deadline=$4 rc left
  shift 4
  if [ "$DRY" = 1 ]; then
    # NOTE: the dry run's CPU (2 shared cores in CI) is far slower than the GPU machine, and it
    # checks that every step still runs, not how fast: three times the room there.
    limit=$((limit * 3))
    [ "$deadline" = - ] || deadline=$((deadline * 3))
  fi
  left=$((BUDGET - (SECONDS - T0)))
  if [ "$left" -lt 10 ]; then
    echo "=== $name: skipped, the budget of ${BUDGET}s is spent"
    STEPS+=("$name skipped 0 $limit $estimate")
    write_steps false
    return 1
  fi
  if [ "$limit" -gt "$left" ]; then  # the deadline keeps the same room before the limit
    [ "$deadline" = - ] || deadline=$((deadline - (limit - left) > 1 ? deadline - (limit - left) : 1))
    limit=$left
  fi
  [ "$deadline" = - ] || set -- "$@" --deadline "$deadline"
  echo "=== $name (limit ${limit}s, estimate ${estimate}s on an H200): $*"
  STEP_START=$SECONDS
  STEPS+=("$name running 0 $limit $estimate")
  write_steps false
  # NOTE: in the background and waited for, so a signal reaches on_signal at once; timeout puts the
  # step in a process group of its own, and kills it 10 s after its TERM if it has not ended
  timeout -k 10 "$limit" "$@" &
  CHILD=$!
  wait "$CHILD"
  rc=$?
  CHILD=""
  local seconds=$((SECONDS - STEP_START)) status=ok
  if [ $rc -eq 0 ]; then
    echo "=== $name: ok ($seconds s)"
  else
    status=failed
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && status=timed-out
    echo "=== $name: FAILED (exit $rc$([ "$status" = timed-out ] && echo ', timed out'), $seconds s)"
  fi
  STEPS[${#STEPS[@]} - 1]="$name $status $seconds $limit $estimate"
  write_steps false
  return $rc
}

echo "gpu_check $([ "$DRY" = 1 ] && echo '--dry-run (CPU) ')$(date -u +%FT%TZ) in $PWD, log $LOG, budget ${BUDGET}s"
ENV_FLAGS=(--json "$OUT_DIR/env.json")
[ "$DRY" = 1 ] && ENV_FLAGS+=(--dry-run)
#    name              estimate limit deadline command
step environment             10    60 -  "$PY" benchmarks/gpu_check/gpu_env_check.py "${ENV_FLAGS[@]}" || exit 1
step checkpoint              15    60 -  "$PY" benchmarks/gpu_check/gpu_models.py "$WORK" "${MODELS[@]}" || exit 1
step checks                  60   120 90 "$PY" -m tests.gpu_checks --device "$DEVICE" --model "$WORK/minilm" "${CHECKS[@]}"
step collectives             10    45 30 "$PY" benchmarks/gpu_check/gpu_collectives.py "${COLLECTIVES[@]}" \
  --json "$OUT_DIR/collectives.json"
step multi-device             3 "$MULTI_LIMIT" - "$PY" benchmarks/gpu_check/multi_device_check.py --model "$WORK/minilm" "${MULTI[@]}"
step tensor-parallel          3 "$TP_LIMIT" - "$PY" benchmarks/gpu_check/tp_check.py "${TP[@]}" --work "$WORK/tp" \
  --json "$OUT_DIR/tp.json"
step paged-attention         15    45 30 "$PY" benchmarks/gpu_check/gpu_paged_attention.py "${PAGED[@]}" \
  --json "$OUT_DIR/paged_attention.json"
step generation             150   200 150 "$PY" benchmarks/speed/bench_generate.py "${GEN[@]}" --json "$OUT_DIR/generate.json"
step benchmark               55    90 60 "$PY" benchmarks/speed/bench_embed.py --device "$BENCH_DEVICE" --model "$WORK/$BERT" \
  "${EMBED[@]}" --variants "streams=1,graphs=0;streams=2,graphs=0" --skip naive --min-cosine 0.999 \
  --json "$OUT_DIR/bench.json"
step benchmark-decoder       55    90 60 "$PY" benchmarks/speed/bench_embed.py --device "$BENCH_DEVICE" \
  --model "$WORK/$DECODER" "${EMBED[@]}" --variants "streams=1,graphs=0;streams=2,graphs=0" --skip naive \
  --min-cosine "$DECODER_COSINE" --json "$OUT_DIR/bench_decoder.json"

write_steps true
# the verdict: every step ran and passed (the dry run: every GPU step has a CPU twin that ran)
"$PY" benchmarks/gpu_check/gpu_steps.py "$OUT_DIR/steps.json"
status=$?
echo "gpu_check: $([ $status -eq 0 ] && echo PASSED || echo FAILED) in $((SECONDS - T0)) s; results in $OUT_DIR, log $LOG"
exit $status
