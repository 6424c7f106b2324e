"""Transformers backend: the reference every other backend is checked against.

One process, or data-parallel under torchrun (each rank holds the whole model). Only the scored positions go
through the output projection: the decoder runs once, then `lm_head` sees N hidden states instead of B x S.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nano_eval.errors import NanoEvalError
from nano_eval.models.base import Batch
from nano_eval.packing import tree_attention_mask
from nano_eval.parallel import ParallelLayout

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class TransformersModel:
    """A causal LM from transformers behind the backend protocol (see nano_eval.models.base.Backend).

    Takes packed rows (nano_eval.packing) when its attention takes a custom 4D mask (sdpa: bool, eager: additive).
    """

    supports_packed_rows = True

    def __init__(self, model, tokenizer, *, layout: ParallelLayout | None = None, max_length: int | None = None):
        self.model = self.module = model
        self.tokenizer = tokenizer
        self.layout = layout or ParallelLayout.data_parallel()
        self.max_length = max_length or _model_max_length(model, tokenizer)
        self.device = next(model.parameters()).device
        self._head_only_on_scored = _can_split_head(model)
        self._attn = getattr(model.config, "_attn_implementation", None)
        self.supports_packed_rows = self._attn in ("sdpa", "eager")

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_length: int | None = None,
        trust_remote_code: bool = False,
        layout: ParallelLayout | None = None,
    ) -> TransformersModel:
        """Load a model folder (or Hub id). Weights load through safetensors where present; remote code stays off
        unless asked for."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        check_model_dir(path)
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code, use_safetensors=_has_safetensors(path)
        )
        return cls(model.to(device), tokenizer, layout=layout, max_length=max_length)

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [N, V] at the scored positions (tp = pp = 1, so every rank is an output stage)."""
        inputs = {"input_ids": batch.input_ids.to(self.device), "attention_mask": batch.attention_mask.to(self.device)}
        if batch.position_ids is not None:
            inputs["position_ids"] = batch.position_ids.to(self.device)
            inputs["attention_mask"] = self._tree_mask(batch)
        rows, cols = batch.rows.to(self.device), batch.cols.to(self.device)
        if not self._head_only_on_scored:
            return self.model(**inputs, use_cache=False).logits[rows, cols]
        hidden = self.model.get_decoder()(**inputs, use_cache=False).last_hidden_state
        # Choices of one document are scored at the same position (the context's last token): project it once.
        flat, inverse = torch.unique(rows * hidden.shape[1] + cols, return_inverse=True)
        scored = hidden.flatten(0, 1)[flat]
        return self.model.get_output_embeddings()(scored)[inverse]

    def _tree_mask(self, batch: Batch) -> torch.Tensor:
        """4D mask from the batch's segment/branch ids: bool for sdpa (True = attend), additive for eager."""
        if not self.supports_packed_rows:
            raise NanoEvalError(f"attention implementation {self._attn!r} cannot take packed rows. Fix: use sdpa or "
                                "eager attention, or BatchingConfig(packing=False).")
        mask = tree_attention_mask(batch.segment_ids.to(self.device), batch.branch_ids.to(self.device))
        if self._attn == "sdpa":
            return mask
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill_(~mask, torch.finfo(dtype).min)


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


def _has_safetensors(path: str) -> bool | None:
    p = Path(path)
    if not p.is_dir():
        return None
    return any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").exists()


def _model_max_length(model, tokenizer) -> int:
    for attr in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(model.config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    if 0 < getattr(tokenizer, "model_max_length", 0) < 1_000_000:
        return tokenizer.model_max_length
    return 2048


def _can_split_head(model) -> bool:
    """Running lm_head on scored positions only is exact when the logits are a plain projection of the decoder's
    last hidden state (no soft-capping or scaling after it)."""
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return False
    try:
        return model.get_decoder() is not None and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False
