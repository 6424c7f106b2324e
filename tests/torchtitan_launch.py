"""TEST-ONLY launcher: run a script (hooks/torchtitan_eval.py, or torchtitan's own train.py with `-m`) on CPU through
the torchtitan test double (tests/torchtitan_cpu.py), under torchrun.

    python -m torch.distributed.run --nproc_per_node=2 tests/torchtitan_launch.py hooks/torchtitan_eval.py \\
        --module tests.torchtitan_configs --config tiny_llama ... --nano-eval eval.yaml
    python -m torch.distributed.run --nproc_per_node=2 tests/torchtitan_launch.py -m torchtitan.train ...

NANO_EVAL_TEST_LOSSES=PATH: every rank appends each step's loss, as the exact float torchtitan logs, to
PATH.rank<R>.jsonl (the with / without evaluation comparison). The scripts themselves are unchanged product code.
"""

import functools
import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.torchtitan_cpu import install  # noqa: E402


def record_losses(path: str) -> None:
    from torchtitan.components.metrics import MetricsProcessor

    log = MetricsProcessor.log

    @functools.wraps(log)
    def logged(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        with open(f"{path}.rank{os.environ['RANK']}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": global_avg_loss, "max_loss": global_max_loss,
                                "grad_norm": grad_norm}) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    MetricsProcessor.log = logged


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    install()
    if os.environ.get("NANO_EVAL_TEST_LOSSES"):
        record_losses(os.environ["NANO_EVAL_TEST_LOSSES"])
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, sys.argv = sys.argv[1], sys.argv[1:]
        runpy.run_path(script, run_name="__main__")
