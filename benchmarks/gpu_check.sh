#!/usr/bin/env bash
# The GPU check, for a machine with one CUDA GPU (under 3 minutes, no downloads):
#   1. the GPU-marked tests: CUDA equals CPU, staging slots never reused early, graphs equal eager;
#   2. bench_embed.py on the GPU: hpcinfer against sentence-transformers on the same GPU, with the
#      device busy share and H2D/compute overlap from hpcinfer's own report.
# Usage: bash benchmarks/gpu_check.sh [python]   (run from anywhere; needs torch with CUDA installed)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))" || exit 1
status=0
timeout 120 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider || status=1
timeout 150 "$PY" benchmarks/bench_embed.py --device cuda --st-batch-sizes 32,128,512 || status=1
exit $status
