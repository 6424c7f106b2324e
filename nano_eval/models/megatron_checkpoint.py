"""Score Megatron checkpoints from the command line, on any machine.

`run.py --checkpoint <iter_XXXXXXX folder or run dir> --tokenizer T` reads a Llama-style GPT checkpoint into
transformers' LlamaForCausalLM (nano_eval/models/megatron_to_hf.py): same scores, no Megatron-LM, no GPU. Both formats:
legacy `mp_rank_XX[_YYY]/model_optim_rng.pt` and torch_dist (`*.distcp`; read with megatron-core). A run dir
(holding `latest_checkpointed_iteration.txt`) resolves to its latest `iter_%07d` folder, as Megatron's loader does.
Megatron does not store the tokenizer with the weights, so --tokenizer is required. Inside a training job, score
the live model with MegatronModel (nano_eval/integrations/megatron_pretrain.py) instead.
"""

from __future__ import annotations

import re
from pathlib import Path

from nano_eval.errors import NanoEvalError

TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")


def is_megatron_checkpoint(path: str) -> bool:
    """An `iter_*` / `release` folder (mp_rank_* shards or torch_dist files), or a run dir with a tracker file."""
    p = Path(path)
    if not p.is_dir():
        return False
    if (p / TRACKER).is_file():
        return True
    return bool(ITER_DIR.match(p.name)) and (any(p.glob("mp_rank_*")) or (p / ".metadata").exists())


def resolve_iteration_dir(path: str) -> Path:
    """The iteration folder: `path` itself, or the one the run dir's tracker names (an int, or "release")."""
    p = Path(path)
    if not (p / TRACKER).is_file():
        return p
    text = (p / TRACKER).read_text().strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None or not (p / name).is_dir():
        raise NanoEvalError(f"{p / TRACKER} says {text!r} but {p / (name or '?')} does not exist. "
                            "Fix: pass an iter_XXXXXXX folder directly.")
    return p / name


def load_as_transformers(checkpoint: str, tokenizer_path: str | None, *, device: str = "cpu", dtype: str = "float32",
                         max_length: int | None = None, megatron_args: dict | None = None):
    """A TransformersModel backend holding the Megatron checkpoint's weights."""
    import torch
    from transformers import AutoTokenizer

    from nano_eval.models.megatron_to_hf import load_megatron_llama_as_hf
    from nano_eval.models.transformers_model import TransformersModel

    if not tokenizer_path:
        raise NanoEvalError(f"checkpoint {checkpoint}: Megatron checkpoints do not hold a tokenizer. "
                            "Fix: pass --tokenizer PATH_OR_HUB_ID (the one the run trained with).")
    model = load_megatron_llama_as_hf(resolve_iteration_dir(checkpoint), megatron_args)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    return TransformersModel(model, AutoTokenizer.from_pretrained(tokenizer_path), max_length=max_length)
