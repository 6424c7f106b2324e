"""The last step of every checkpoint converter: a transformers Llama from a converted state dict."""

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
