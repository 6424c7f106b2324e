"""torchtitan's `python -m torchtitan.train` with evaluation: train with torchtitan's own Trainer and score the live
model as it trains.

    torchrun --nproc_per_node=8 hooks/torchtitan_eval.py --module llama3 --config llama3_8b \\
        --parallelism.tensor_parallel_degree 2 --nano-eval examples/torchtitan_eval.yaml

Every argument but `--nano-eval FILE` is torchtitan's own command line (`--module`, `--config` and its overrides),
parsed by torchtitan's ConfigManager. FILE is a YAML of nano_eval options, the same keys as nanotron's `nano_eval:`
section (tasks, interval, on_save, max_samples, time_budget_s, batch_tokens, output_dir, W&B options, fail_soft)
plus `unshard` (annotated in examples/torchtitan_eval.yaml). The trainer is the config's own Trainer class with
`NanoEvalTrainerMixin` (nano_eval/training/torchtitan.py): it builds the evaluation once and runs it after the
steps at the interval and after each checkpoint save, on every rank, in the model's own FSDP2 / TP / PP layout.
To add evaluation to your own launcher instead: `trainer_class(YourTrainer, read_options(FILE))(config)`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def split_argv(argv: list[str]) -> tuple[str | None, list[str], dict]:
    """(the --nano-eval file, torchtitan's own arguments, {"module", "config"} as torchtitan reads them)."""
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--nano-eval", dest="nano_eval")
    known, rest = ours.parse_known_args(argv)
    names = argparse.ArgumentParser(add_help=False)
    names.add_argument("--module")
    names.add_argument("--config")
    found, _ = names.parse_known_args(rest)
    return known.nano_eval, rest, {"module": found.module, "config": found.config}


def main(argv: list[str] | None = None) -> None:
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from nano_eval.errors import NanoEvalError
    from nano_eval.training.torchtitan import read_options, trainer_class

    init_logger()
    path, rest, model = split_argv(sys.argv[1:] if argv is None else argv)
    try:
        options = read_options(path) if path else None
    except NanoEvalError as e:
        print(f"nano_eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    config = ConfigManager().parse_args(rest)
    trainer = None
    try:
        trainer = trainer_class(type(config)._owner, options, model)(config)
        if config.checkpoint.create_seed_checkpoint:
            assert int(os.environ.get("WORLD_SIZE", "1")) == 1, "a seed checkpoint is created on one device"
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
