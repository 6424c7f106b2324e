"""What every checkpoint converter shares: a transformers Llama from a converted state dict, and the one rotary
permutation (interleaved pairs -> rotate-half)."""

from __future__ import annotations

import torch

from nano_eval.errors import NanoEvalError


def llama_from_state_dict(config, state: dict[str, torch.Tensor], where: str):
    """LlamaForCausalLM(config) holding `state` exactly: every weight present (lm_head may be the tied embedding),
    nothing left over; otherwise a NanoEvalError naming `where` and what does not fit."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise NanoEvalError(f"{where}: weights do not fit a Llama (missing {missing}, unexpected {unexpected}).")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def interleaved_to_half_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k projection rows from interleaved-pair rotary order to transformers' rotate-half order.

    Interleaved rotary (nanotron's training convention, flash-attn `interleaved=True`, Megatron's
    `rotary_interleaved=True`) rotates pairs (x[2i], x[2i+1]); transformers' Llama rotates halves (x[i], x[i + d/2]).
    Per head, rows [r0, r1, r2, r3, ...] become [r0, r2, ..., r1, r3, ...]. w: [heads * head_dim, in_features]."""
    d = w.shape[0] // heads
    return w.view(heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)
