#!/usr/bin/env bash
# A second environment with megatron-core 0.19.2 (the newest release) for the megatron tests, next to the main
# environment's 0.16.1 (scripts/setup.sh; other tests need it unchanged). Run after scripts/setup.sh: the venv sees
# that environment's packages (--system-site-packages) and shadows only megatron-core, plus triton (0.19 imports it
# at module level; no Triton kernel runs on CPU).
# --ignore-requires-python: megatron-core 0.17+ declare Python >= 3.12, yet install and import on 3.11 (the machines
# here have 3.11 only); --no-deps: its dependencies are the main environment's, and torch stays the one installed.
# Then: NANO_EVAL_REQUIRE_MEGATRON=0.19.2 .venv-mc19/bin/python -m pytest tests/test_megatron.py ... (.ci/run does).
# VENV: where (default .venv-mc19).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-mc19}"
TORCH_BEFORE="$(python -c 'import torch; print(torch.__version__)')"
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps --ignore-requires-python \
  "megatron-core==0.19.2" "triton==3.8.0"
# the venv's megatron-core must be 0.19.2 from the venv, over the main environment's torch
NO_VCS_VERSION=1 "$VENV/bin/python" -W ignore - "$VENV" "$TORCH_BEFORE" <<'PY'
import sys
from pathlib import Path

import megatron.core
import torch
from megatron.core import package_info

venv, torch_before = Path(sys.argv[1]).resolve(), sys.argv[2]
assert Path(megatron.core.__file__).resolve().is_relative_to(venv), megatron.core.__file__
assert package_info.__version__ == "0.19.2", package_info.__version__
assert torch.__version__ == torch_before, (torch.__version__, torch_before)
print(f"megatron-core {package_info.__version__}: {megatron.core.__file__} (torch {torch.__version__})")
PY
