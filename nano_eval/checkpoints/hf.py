"""transformers model folders and Hub ids: check that a folder holds a model, then load it as a backend.

Weights load through safetensors where present; a checkpoint's own Python code (trust_remote_code) stays off
unless asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nano_eval.backends.transformers import TransformersModel
from nano_eval.checkpoints.files import check_safetensors, load_tokenizer, read_json_file
from nano_eval.errors import NanoEvalError
from nano_eval.parallel import ParallelLayout

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def load_transformers(path: str, *, device: str = "cpu", dtype: str = "float32", max_length: int | None = None,
                      trust_remote_code: bool = False, layout: ParallelLayout | None = None,
                      tokenizer: str | None = None) -> TransformersModel:
    """A TransformersModel backend from a model folder (saved with save_pretrained) or a Hub id; `tokenizer`
    (a folder or Hub id) replaces the checkpoint's own."""
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    tokenizer = load_tokenizer(tokenizer or path, path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code, use_safetensors=_has_safetensors(path)
    )
    return TransformersModel(model.to(device), tokenizer, layout=layout, max_length=max_length)


def check_model_dir(path: str) -> None:
    """A local checkpoint folder must hold weights: say so clearly instead of failing deep inside transformers."""
    p = Path(path)
    if not p.exists():
        if os.sep in path or path.startswith("."):
            raise NanoEvalError(f"checkpoint {path} does not exist. Fix: pass the folder that holds config.json.")
        return  # a Hub id: transformers handles it
    if not p.is_dir():
        raise NanoEvalError(f"checkpoint {path} is a file. Fix: pass the folder that holds config.json and the weights.")
    if not (p / "config.json").exists():
        raise NanoEvalError(f"checkpoint {path} has no config.json. Fix: pass a transformers model folder.")
    if not any((p / f).exists() for f in WEIGHT_FILES):
        raise NanoEvalError(
            f"checkpoint {path} has no weights (looked for {', '.join(WEIGHT_FILES)}). "
            "Fix: point --checkpoint at a folder saved with save_pretrained, or finish copying the checkpoint."
        )
    config = read_json_file(p / "config.json", f"checkpoint {path}")
    if "model_type" not in config:
        raise NanoEvalError(f"checkpoint {path}: {p / 'config.json'} has no model_type, so transformers cannot tell "
                            "which model it is. Fix: restore config.json from the run that saved the checkpoint.")
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (p / index).exists():
            read_json_file(p / index, f"checkpoint {path}")
    check_safetensors(sorted(p.glob("*.safetensors")), path)


def _has_safetensors(path: str) -> bool | None:
    p = Path(path)
    if not p.is_dir():
        return None
    return any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").exists()
