"""Score nanotron checkpoints from the command line, on any machine.

A nanotron checkpoint folder holds `config.yaml` and `model/` (sharded safetensors with their TP/PP layout in the
file names). nanotron's own model classes need flash-attn on CUDA, so the command line reads Llama checkpoints
into transformers' LlamaForCausalLM (nano_eval/models/nanotron_to_hf.py): same scores, any machine, any saved
layout. Inside a training job, score the live model with NanotronModel instead.
"""

from __future__ import annotations

from pathlib import Path

from nano_eval.errors import NanoEvalError


def is_nanotron_checkpoint(path: str) -> bool:
    p = Path(path)
    return (p / "config.yaml").is_file() and (p / "model").is_dir()


def tokenizer_path(checkpoint: str, override: str | None) -> str:
    """--tokenizer, else config.yaml's tokenizer.tokenizer_name_or_path."""
    if override:
        return override
    import yaml

    config = yaml.safe_load((Path(checkpoint) / "config.yaml").read_text()) or {}
    name = (config.get("tokenizer") or {}).get("tokenizer_name_or_path")
    if not name:
        raise NanoEvalError(
            f"checkpoint {checkpoint}: config.yaml names no tokenizer (tokenizer.tokenizer_name_or_path). "
            "Fix: pass --tokenizer PATH_OR_HUB_ID."
        )
    return name


def load_as_transformers(checkpoint: str, tokenizer: str | None, *, device: str, dtype: str, max_length: int | None):
    """A TransformersModel backend holding the nanotron checkpoint's weights."""
    import torch
    from transformers import AutoTokenizer

    from nano_eval.models.nanotron_to_hf import load_nanotron_llama_as_hf
    from nano_eval.models.transformers_model import TransformersModel

    tok = AutoTokenizer.from_pretrained(tokenizer_path(checkpoint, tokenizer))
    model = load_nanotron_llama_as_hf(checkpoint).to(device=device, dtype=getattr(torch, dtype))
    return TransformersModel(model, tok, max_length=max_length)
