#!/usr/bin/env bash
# Context parallelism through Transformer Engine on real GPUs (CPU runs only emulate it: tests/test_megatron_moe.py).
# Needs 2+ CUDA GPUs, megatron-core and transformer-engine. Runs tests/test_megatron_gpu.py's CP test: a GPTModel
# with TE attention at cp2 scored as two data-parallel ranks, equal to transformers on the same weights, with TE's
# CP group off while scoring and the same group back after. Usage: bash scripts/gpu_check_megatron_cp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then echo "gpu_check_megatron_cp: needs 2 GPUs, found $gpus" >&2; exit 2; fi
python -c "import transformer_engine, megatron.core" || {
  echo "gpu_check_megatron_cp: install transformer-engine and megatron-core first" >&2; exit 2; }
exec timeout 900 python -m pytest tests/test_megatron_gpu.py -m gpu -k "context_parallel" -q -rs -p no:cacheprovider
