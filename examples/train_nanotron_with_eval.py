"""Train a tiny Llama with nanotron's own DistributedTrainer and score it as it trains, from examples/nanotron_eval.yaml.

    torchrun --nproc_per_node=2 examples/train_nanotron_with_eval.py --steps 20                    # GPU node: TP2
    torchrun --nproc_per_node=2 examples/train_nanotron_with_eval.py --steps 20 --cpu-test-double  # CPU only

The trainer is nanotron 0.4's real `DistributedTrainer` with nano_eval's `NanoEvalTrainerMixin`, exactly what
hooks/nanotron_eval.py runs. nanotron's Llama imports flash-attn, which needs CUDA. On a machine without a GPU,
`--cpu-test-double` runs it anyway with this repository's TEST DOUBLE: tests/nanotron_cpu.py puts a torch-only
stand-in for flash-attn (tests/flash_attn_double/) on the path and patches nanotron's CUDA-only literals to CPU and
gloo. It is for trying things out and for the test suite, not for training; nano_eval itself never imports it.

The training data is nanotron's dummy token stream (`data.dataset: null`); the toy tokenizer and all outputs go
under --output-dir. W&B runs offline into <output-dir>; the eval metrics land next to `lm_loss` on
`iteration_step`.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing


def write_run_config(template: Path, out: Path, steps: int | None) -> Path:
    """The example YAML with its paths moved under `out` and the toy tokenizer written there."""
    from nano_eval.toy import build_tokenizer

    config = yaml.safe_load(template.read_text())
    tokenizer_dir = out / "toy_tokenizer"
    build_tokenizer().save_pretrained(tokenizer_dir)
    config["tokenizer"]["tokenizer_name_or_path"] = str(tokenizer_dir)
    config["checkpoints"]["checkpoints_path"] = str(out / "checkpoints")
    config["nano_eval"]["output_dir"] = str(out / "eval")
    if steps:
        config["tokens"]["train_steps"] = steps
        config["nano_eval"]["interval"] = max(1, steps // 4)
    path = out / f"run_config_rank{os.environ.get('RANK', '0')}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config-file", default=str(REPO / "examples" / "nanotron_eval.yaml"))
    p.add_argument("--output-dir", default="nanotron_eval_out")
    p.add_argument("--steps", type=int, default=None, help="override tokens.train_steps (and evaluate 4 times)")
    p.add_argument("--cpu-test-double", action="store_true",
                   help="no GPU: run nanotron on CPU with the repository's flash-attn test double (tests/)")
    args = p.parse_args()
    import torch

    if args.cpu_test_double:
        from tests.nanotron_cpu import install  # TEST DOUBLE, see the module docstring

        torch.set_num_threads(1)
        install(trainer=True)
    elif not torch.cuda.is_available():
        p.exit(2, "train_nanotron_with_eval.py: error: nanotron's trainer needs CUDA and flash-attn; on a CPU machine "
                  "add --cpu-test-double (runs it with the test double from tests/)\n")
    os.environ.setdefault("WANDB_MODE", "offline")
    out = Path(args.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_DIR", str(out))
    run_config = write_run_config(Path(args.config_file), out, args.steps)  # each rank its own copy

    from nano_eval.tracking.jsonl import read_jsonl
    from nano_eval.training.hook import JSONL_NAME
    from nano_eval.training.nanotron import config_class, trainer_class

    get_dataloader = runpy.run_path(str(REPO / "hooks" / "nanotron_eval.py"))["get_dataloader"]
    trainer = trainer_class()(str(run_config), config_class=config_class())
    trainer.train(get_dataloader(trainer))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"evaluation took {trainer.nano_eval_hook.time_share:.0%} of wall time")
        for row in read_jsonl(Path(trainer.nano_eval_options.hook.output_dir) / JSONL_NAME):
            if "failed" in row:  # a fail-soft failure: the step's row says why
                print(f"step {row['step']:>4}: failed: {row['failed']}")
                continue
            scores = ", ".join(f"{task} {name}={value:.3f}" for task, metrics in row["results"].items()
                               for name, value in list(metrics.items())[:1])
            print(f"step {row['step']:>4} tokens {row['consumed_tokens']:>7}: {scores}")


if __name__ == "__main__":
    main()
