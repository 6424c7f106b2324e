"""Transformers backend: the reference every other backend is checked against.

One process, or data-parallel under torchrun (each rank holds the whole model). Only the scored positions go
through the output projection: the decoder runs once, then `lm_head` sees N hidden states instead of B x S.
"""

from __future__ import annotations

import torch

from nano_eval.backends.base import Batch
from nano_eval.errors import NanoEvalError
from nano_eval.parallel import ParallelLayout
from nano_eval.rows import tree_attention_mask


class TransformersModel:
    """A causal LM from transformers behind the backend protocol (see nano_eval.backends.base.Backend).

    Takes packed rows (nano_eval.rows) when its attention takes a custom 4D mask (sdpa: bool, eager: additive).
    Load a saved model folder or Hub id with nano_eval.checkpoints.hf.load_transformers.
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
