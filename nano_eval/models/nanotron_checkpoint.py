"""Recognise nanotron checkpoints and say clearly what loading one needs.

A nanotron checkpoint folder holds `config.yaml` and `model/` (sharded safetensors with their TP/PP layout in the
file names). Building its model class (Llama, Qwen2) needs flash-attn and a CUDA device.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from nano_eval.errors import NanoEvalError


def is_nanotron_checkpoint(path: str) -> bool:
    p = Path(path)
    return (p / "config.yaml").is_file() and (p / "model").is_dir()


def missing_requirements() -> list[str]:
    """What this machine lacks to build nanotron's model classes (empty when it can)."""
    import torch

    missing = []
    if importlib.util.find_spec("nanotron") is None:
        missing.append("nanotron (pip install 'nano_eval[nanotron]')")
    if importlib.util.find_spec("flash_attn") is None:
        missing.append("flash-attn (pip install flash-attn)")
    if not torch.cuda.is_available():
        missing.append("a CUDA device")
    return missing


def check_can_load(path: str) -> None:
    missing = missing_requirements()
    if missing:
        raise NanoEvalError(
            f"checkpoint {path} is a nanotron checkpoint (config.yaml + model/). nanotron builds its Llama/Qwen2 "
            f"models with flash-attn on CUDA, and this machine lacks: {', '.join(missing)}. Fix: run on a GPU node "
            "with those installed, or score the live model from the trainer with NanotronModel (see the README)."
        )
    raise NanoEvalError(
        f"checkpoint {path}: loading nanotron checkpoints from the command line is not implemented yet. Fix: score "
        "the model inside the nanotron trainer with NanotronModel (see the README)."
    )
