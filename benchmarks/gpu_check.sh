#!/usr/bin/env bash
# GPU checks of issue 17, for a machine with a CUDA device (CI never runs this; GPU tests skip without CUDA):
#   1. the GPU-marked tests (local model and --device cuda servers on small bfloat16 checkpoints);
#   2. issue 54: `python -m swarm.benchmark invariance-cost --device cuda` on a 2-block checkpoint of LLaDA-8B's widths:
#      the start-up invariance check's verdict on this GPU (first line per dtype) and the cost of invariant passes
#      (1 and 4 states of 16-512 positions, bfloat16 and float32);
#   3. `python -m swarm.benchmark realscale` on 32 blocks of LLaDA-8B's widths (random bfloat16 weights, about
#      16 GB written to $TMPDIR and deleted after), served by 4 GPU servers of 8 blocks; it prints per-step
#      figures and tokens/s for each setting.
# Budget: under 8 minutes in all (each part has its own timeout).      Usage: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA device here')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
df -h "${TMPDIR:-/tmp}" | tail -1
started=$SECONDS

echo "== GPU-marked tests"
timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_real_size.py

echo "== invariance on this GPU: the check's verdict and what invariant passes cost"
timeout 150 python -m swarm.benchmark invariance-cost --device cuda --dtypes bfloat16,float32

echo "== realscale: 32 blocks of LLaDA-8B widths on 4 GPU servers"
timeout 330 python -m swarm.benchmark realscale --blocks 32 --span 8 --device cuda --threads 2 --gen-length 16 \
    --prompt-tokens 16

echo "gpu_check: done in $((SECONDS - started)) s"
