"""Train a tiny nanotron-built Llama on CPU with in-training evaluation, from the same YAML the GPU launcher reads.

    torchrun --nproc_per_node=2 examples/train_nanotron_with_eval.py            # TP2, as the YAML says
    torchrun --nproc_per_node=4 examples/train_nanotron_with_eval.py --dp 2     # TP2 x DP2

nanotron's own DistributedTrainer needs CUDA and flash-attn, so on CPU the trainer is `ToyNanotronTrainer`
(tests/toy_nanotron_trainer.py): nanotron's config parser, parallel modules, sharded cross-entropy and
checkpoint writer, with the trainer's hook order. The evaluation part is the real thing, the same
`NanoEvalTrainerMixin` that hooks/nanotron_eval.py puts on DistributedTrainer. W&B runs offline into
<output-dir>/checkpoints/wandb; the eval metrics land next to `lm_loss` against `iteration_step`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nano_eval.tracking.jsonl import read_jsonl  # noqa: E402
from nano_eval.training.hook import JSONL_NAME  # noqa: E402
from nano_eval.training.nanotron import NanoEvalTrainerMixin, config_class  # noqa: E402
# Temporary: the CPU stand-in for nanotron's trainer lives in tests/ until the real trainer runs here.
from tests.toy_nanotron_trainer import ToyNanotronTrainer  # noqa: E402

HERE = Path(__file__).resolve().parent


class ToyEvaluatingTrainer(NanoEvalTrainerMixin, ToyNanotronTrainer):
    """What hooks/nanotron_eval.py builds on GPU, with the CPU stand-in in place of DistributedTrainer."""


def write_run_config(template: Path, out: Path, dp: int, steps: int | None) -> Path:
    """The example YAML with its paths moved under `out` and the toy tokenizer written there."""
    from nano_eval.toy import build_tokenizer

    config = yaml.safe_load(template.read_text())
    tokenizer_dir = out / "toy_tokenizer"
    build_tokenizer().save_pretrained(tokenizer_dir)
    config["tokenizer"]["tokenizer_name_or_path"] = str(tokenizer_dir)
    config["checkpoints"]["checkpoints_path"] = str(out / "checkpoints")
    config["nano_eval"]["output_dir"] = str(out / "eval")
    config["parallelism"]["dp"] = dp
    if steps:
        config["tokens"]["train_steps"] = steps
    path = out / "run_config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config-file", default=str(HERE / "nanotron_eval.yaml"))
    p.add_argument("--output-dir", default="nanotron_eval_out")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--steps", type=int, default=None, help="override tokens.train_steps")
    args = p.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(args.output_dir).resolve()
    run_config = out / "run_config.yaml"
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        write_run_config(Path(args.config_file), out, args.dp, args.steps)
    dist.barrier()

    trainer = ToyEvaluatingTrainer(str(run_config), config_class=config_class())
    losses = trainer.train()
    if dist.get_rank() == 0:
        print(f"loss: first {losses[0]:.3f}, last {losses[-1]:.3f}; eval took {trainer.nano_eval_hook.time_share:.0%}"
              " of wall time")
        for row in read_jsonl(Path(trainer.nano_eval_options.hook.output_dir) / JSONL_NAME):
            if "failed" in row:  # a fail-soft failure: the step's row says why
                print(f"step {row['step']:>4}: failed: {row['failed']}")
                continue
            scores = ", ".join(f"{task} {name}={value:.3f}" for task, metrics in row["results"].items()
                               for name, value in list(metrics.items())[:1])
            print(f"step {row['step']:>4} tokens {row['consumed_tokens']:>7}: {scores}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
