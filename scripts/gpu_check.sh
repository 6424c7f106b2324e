#!/usr/bin/env bash
# The GPU check: every GPU-marked test (tests/test_gpu.py, tests/test_megatron_gpu.py, tests/test_sweep.py), bf16
# parity on SmolLM2-135M-sized models (transformers, nanotron with flash-attn's CUDA kernels, Megatron with
# Megatron-LM's default fusions where Apex's fused softmax is installed) and a scoring throughput figure.
# Needs one CUDA GPU (more GPUs add the tp2 / pp2 Megatron layouts) and the packages of scripts/setup.sh with
# flash-attn's kernels (FLASH_ATTN_CUDA=1). Ends by itself within 8 minutes; exits non-zero on any mismatch, error or
# timeout. The log goes to $GPU_CHECK_LOG (default gpu_check.log); its "gpu_check:" lines are the figures.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="${GPU_CHECK_LOG:-gpu_check.log}"
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: error: no CUDA device visible to torch. Fix: run on a GPU machine with a CUDA build of torch." >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu_check: device: /'
start=$(date +%s)
timeout --signal=INT --kill-after=20 470 python -m pytest -m gpu -p no:cacheprovider -q -s -rs \
  tests/test_gpu.py tests/test_megatron_gpu.py tests/test_sweep.py 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
echo "---- summary ($(( $(date +%s) - start )) s, pytest exit $status) ----"
grep -h "^gpu_check:" "$LOG" || true
grep -hE "^SKIPPED" "$LOG" || true
if [ "$status" -eq 124 ]; then
  echo "gpu_check: error: timed out after 470 s" >&2
fi
exit "$status"
