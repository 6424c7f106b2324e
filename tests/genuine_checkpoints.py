"""Genuine checkpoints of every kind nano_eval reads, written by the frameworks' own save functions, for the
hostile-file and fuzz tests: a transformers folder (safetensors, and pytorch_model.bin), a nanotron checkpoint
(nanotron's save_weights), a Megatron legacy iteration (torch.save of a GPTModel state dict with Megatron's args,
as Megatron-LM's save_checkpoint writes it) and a Megatron torch_dist iteration (megatron-core's
dist_checkpointing.save). All of them hold small models (hidden 32-64) so that hundreds of loads take seconds.

`make_framework_checkpoints` runs in a spawned 1-rank world (it needs the CPU test doubles, which must not leak into
the pytest process).
"""

from __future__ import annotations

from pathlib import Path

ITERATION = 7


def make_hf(root: Path, tokenizer_dir: Path, *, safetensors: bool = True) -> Path:
    """A tiny transformers Llama saved with save_pretrained, with the toy tokenizer beside it; `safetensors=False`:
    its weights as `pytorch_model.bin` instead, the torch.save'd state dict older transformers versions write."""
    import torch
    from transformers import AutoTokenizer

    from nano_eval.toy import build_model

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = build_model(len(tokenizer), seed=3, hidden=32, layers=1)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    if not safetensors:
        (root / "model.safetensors").unlink()
        torch.save(model.state_dict(), root / "pytorch_model.bin")
    return root


def _megatron_pair(rank, world, root: str, tokenizer_dir: str):
    """Inside a 1-rank world: the tiny GPTModel saved as legacy and as torch_dist (tests/megatron_worker.py's savers,
    which are Megatron-LM's formats written with megatron-core's own functions)."""
    import torch

    from tests.megatron_gpt import GPTConfig, megatron_args
    from tests.megatron_worker import _setup, gpt_model_from_args, save_dist_checkpoint, save_legacy_checkpoint

    _setup(1, 1)
    args = megatron_args(GPTConfig(), tp=1, pp=1)
    model = gpt_model_from_args(args)
    save_legacy_checkpoint(model, args, Path(root) / "legacy", ITERATION)
    save_dist_checkpoint(model, args, Path(root) / "torch_dist", ITERATION)
    return bool(torch.is_tensor(next(iter(model.state_dict().values()))))


def make_framework_checkpoints(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    """{kind: checkpoint path} for "legacy", "torch_dist" and "nanotron", each written by its framework."""
    from tests.dist_utils import run_distributed
    from tests.sweep_utils import save_nanotron_run

    root = Path(root)
    run_distributed(_megatron_pair, 1, str(root), str(tokenizer_dir), timeout=300)
    run_distributed(save_nanotron_run, 1, str(root / "nanotron"), str(tokenizer_dir), [ITERATION], 64, timeout=300)
    return {"legacy": root / "legacy" / f"iter_{ITERATION:07d}",
            "torch_dist": root / "torch_dist" / f"iter_{ITERATION:07d}",
            "nanotron": root / "nanotron" / str(ITERATION)}
