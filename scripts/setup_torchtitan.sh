#!/usr/bin/env bash
# A second environment with torchtitan 0.3.0 (PyPI) for tests/test_torchtitan.py and hooks/torchtitan_eval.py on
# this project's torch, next to the main environment (which has no torchtitan).
# Run after scripts/setup.sh: the venv sees that environment's packages (--system-site-packages: torch 2.13.0,
# transformers, datasets, wandb, ...) and adds only torchtitan and the few small packages it imports.
# --no-deps: torchtitan pins datasets<4.8 (for its own HF data loader only; the project's datasets 5.x works there)
# and spmd_types 0.2.3, whose backend needs a newer torch than 2.13 (a multi-GB CUDA wheel): torch stays 2.13.0 and
# torchtitan runs with its `partial_dtensor` SPMD backend. triton: imported by torchtitan's MoE code at module level
# (no Triton kernel runs on CPU). VENV: where (default .venv-tt).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-tt}"
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q --no-deps"
$PIP "torchtitan==0.3.0" "spmd_types==0.2.3" "torch_checkpointing==0.1.1" "torchdata==0.11.0" "tyro==1.0.17" \
    "docstring_parser==0.18.0" "typeguard==4.6.1" "tensorboard==2.21.0" "triton==3.8.0"
"$VENV/bin/python" -c "import torch, torchtitan.trainer, torchtitan.models.llama3; \
assert torch.__version__.startswith('2.13.0'), torch.__version__; print('torchtitan', torchtitan.__version__, '| torch', torch.__version__)"
