"""Helpers for the sweep tests: a short CPU training run that saves checkpoints as a trainer would."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

TASKS = "demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"
TOKENS_PER_STEP = 32 * 16  # recorded in trainer_state.json as num_input_tokens_seen = step x this


@contextlib.contextmanager
def one_thread():
    """Tiny models run fastest on one thread, and the CPU is shared with other test processes."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def toy_parts(hidden: int = 64, layers: int = 2):
    from nano_eval.toy import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, build_model(len(tokenizer), seed=0, hidden=hidden, layers=layers)


def save_hf_checkpoint(model, tokenizer, path: Path, step: int) -> Path:
    """A HF Trainer-style checkpoint folder: weights, tokenizer, trainer_state.json with the tokens seen."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    state = {"global_step": step, "num_input_tokens_seen": step * TOKENS_PER_STEP}
    (path / "trainer_state.json").write_text(json.dumps(state))
    return path


def train_run_dir(run_dir: Path, *, saves: int = 6, steps_per_save: int = 8) -> list[Path]:
    """Train one toy Llama on arithmetic, saving `run_dir/checkpoint-<step>` every `steps_per_save` steps."""
    from nano_eval.toy import train_on_arithmetic

    tokenizer, model = toy_parts()
    paths = []
    with one_thread():
        for i in range(1, saves + 1):
            train_on_arithmetic(model, tokenizer, steps_per_save, seed=i)
            paths.append(save_hf_checkpoint(model, tokenizer, run_dir / f"checkpoint-{i * steps_per_save}",
                                            i * steps_per_save))
    return paths


def save_nanotron_run(rank, world, run_dir, tokenizer_dir, steps, seq_len=128):
    """Inside a 1-rank world: nanotron's own save_weights / save_meta write `run_dir/<step>/` for each step (nanotron's
    real Llama, initialised with the step as seed, so the checkpoints differ), then latest.txt, as nanotron's trainer
    does. Needs the CPU test double (tests/nanotron_cpu.py)."""
    import torch

    from tests.nanotron_cpu import install

    install()
    from nanotron.serialize import save_weights
    from nanotron.serialize.metadata import save_meta

    from nano_eval.compat.nanotron import cpu_parallel_context
    from nano_eval.training.nanotron import load_config
    from tests.nanotron_worker import build_llama, write_config

    pc = cpu_parallel_context(tp=1, pp=1, dp=1)
    for step in steps:
        ckpt = Path(run_dir) / str(step)
        ckpt.mkdir(parents=True)
        config_path = write_config(ckpt / "config.yaml", str(tokenizer_dir), Path(run_dir), sequence_length=seq_len)
        config = load_config(config_path)
        model = build_llama(pc, config)
        torch.manual_seed(step)
        model.init_model_randomly(config=config)
        save_weights(model, pc, ckpt)
        save_meta(pc, ckpt, {"last_train_step": step, "consumed_train_samples": step * 4})
        (Path(run_dir) / "latest.txt").write_text(str(step))
    return True
