#!/usr/bin/env bash
# A second environment with nanotron MAIN (huggingface/nanotron 2411b022, the SmolLM3 code: Qwen2ForTraining) for
# tests/test_nanotron_main.py, next to the main environment's nanotron 0.4 (which other tests need unchanged).
# Run after scripts/setup.sh: the venv sees that environment's packages (--system-site-packages) and shadows only
# nanotron, plus triton (nanotron main imports it at module level; no Triton kernel runs on CPU).
# --no-deps: nanotron main pins numpy<2 and flash-attn<2.7; the project runs numpy 2 and flash-attn 2.8.3, which
# nanotron main works with (tests/nanotron_main_cpu.py says where it needs help).
# NANOTRON_MAIN_WHEEL: a wheel of that commit (default: ../shared/wheels/, for machines without GitHub); else it is
# installed from GitHub. VENV: where (default .venv-ntm).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv-ntm}"
WHEEL="${NANOTRON_MAIN_WHEEL:-../shared/wheels/nanotron-0.4+main.2411b022-py3-none-any.whl}"
[ -x "$VENV/bin/python" ] || python -m venv --system-site-packages "$VENV"
PIP="$VENV/bin/python -m pip install --disable-pip-version-check -q --no-deps"
if [ -f "$WHEEL" ]; then
  $PIP "$WHEEL"
else
  $PIP "nanotron @ git+https://github.com/huggingface/nanotron@2411b022a75fb7f7561a1bb4166706da5e1b76de"
fi
$PIP "triton==3.8.0"
# the venv's nanotron must be main (main still calls itself 0.4, like PyPI's release)
"$VENV/bin/python" -c "import importlib.util as u, pathlib; s = u.find_spec('nanotron'); \
assert (pathlib.Path(s.submodule_search_locations[0]) / 'models' / 'qwen.py').is_file(), s.origin; print('nanotron main:', s.origin)"
