"""TEST-ONLY launcher: run a nano_eval script on nanotron MAIN on CPU (tests/nanotron_main_cpu.py), under torchrun.

    python -m torch.distributed.run --nproc_per_node=2 tests/nanotron_main_launch.py hooks/nanotron_eval.py --config-file X

NANO_EVAL_TEST_FIX_PP=1 adds the upstream pipeline-parallel fixes (nanotron_main_cpu.install(fix_pp=True)).
NANO_EVAL_TEST_LOSSES=PATH: every rank that holds the loss (last pipeline stage) appends each step's loss, as the
exact float nanotron logs (`loss_avg.item()`), to PATH.rank<R>.jsonl: the with/without-evaluation comparison.
The scripts themselves are unchanged product code.
"""

import functools
import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.nanotron_main_cpu import install  # noqa: E402


def record_losses(path: str) -> None:
    import nanotron.trainer as nt_trainer

    step_logs = nt_trainer.DistributedTrainer.train_step_logs

    @functools.wraps(step_logs)
    def train_step_logs(self, outputs, loss_avg, *args, **kwargs):
        if loss_avg is not None:
            with open(f"{path}.rank{os.environ['RANK']}.jsonl", "a") as f:
                f.write(json.dumps({"step": self.iteration_step, "loss": loss_avg.item()}) + "\n")
        return step_logs(self, outputs, loss_avg, *args, **kwargs)

    nt_trainer.DistributedTrainer.train_step_logs = train_step_logs


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    install(fix_pp=os.environ.get("NANO_EVAL_TEST_FIX_PP") == "1")
    if os.environ.get("NANO_EVAL_TEST_LOSSES"):
        record_losses(os.environ["NANO_EVAL_TEST_LOSSES"])
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
