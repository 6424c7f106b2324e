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
    # nanotron 0.4's trainer never finishes its W&B run; at process exit wandb's service may not have written the
    # offline log yet (seen: a run without the eval section left no lm_loss rows). Close it as a real job's exit would.
    if "wandb" in sys.modules and sys.modules["wandb"].run is not None:
        sys.modules["wandb"].run.finish()
