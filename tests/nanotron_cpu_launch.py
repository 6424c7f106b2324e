"""TEST-ONLY launcher: run a nano_eval script with nanotron 0.4 on CPU (the flash-attn test double + CPU patches).

    python -m torch.distributed.run --nproc_per_node=2 tests/nanotron_cpu_launch.py hooks/nanotron_eval.py --config-file X
    python -m torch.distributed.run --nproc_per_node=2 tests/nanotron_cpu_launch.py nano_eval/run.py --backend nanotron ...

Installs tests/nanotron_cpu.py (trainer patches included) in this process, then runs SCRIPT as __main__ with the
remaining arguments. The scripts themselves are unchanged product code.
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nanotron_cpu import install  # noqa: E402

if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    install(trainer=True)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
