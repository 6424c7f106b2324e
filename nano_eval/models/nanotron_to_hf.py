"""Read a nanotron Llama checkpoint (any saved TP/PP layout) into a transformers LlamaForCausalLM.

So a checkpoint can be scored where nanotron cannot run (no GPU, no flash-attn). Needs neither nanotron nor a
process group: shards are merged from the slice metadata nanotron writes into every safetensors file.

Two things differ from transformers' Llama:
- fused projections: `qkv_proj` rows are [q | k | v] and `gate_up_proj` rows are [gate | up] (each split across TP
  ranks chunk by chunk; merging by the saved global slices restores the full fused matrix);
- rotary layout: nanotron trains with interleaved rotary pairs (x[2i], x[2i+1]) (flash-attn `interleaved=True`),
  transformers rotates halves (x[i], x[i + d/2]); permuting each head's q/k rows turns one into the other.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from nano_eval.compat.nanotron import NUMPY_SCALAR_REPR  # no nanotron import: plain regex
from nano_eval.errors import NanoEvalError
from nano_eval.models.hf_llama import llama_from_state_dict

_SHARD_SUFFIX = re.compile(r"_pp-rank-\d+-of-\d+_tp-rank-\d+-of-\d+$")


def _slices(text: str) -> tuple[slice, ...]:
    """'0,10,None|None,None,None' -> (slice(0, 10), slice(None))."""
    return tuple(slice(*(None if x == "None" else int(x) for x in part.split(","))) for part in text.split("|"))


def read_nanotron_weights(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """Full tensors keyed by parameter name (e.g. `model.decoder.0.pp_block.attn.qkv_proj.weight`)."""
    from safetensors import safe_open

    root = Path(checkpoint) / "model"
    files = sorted(root.rglob("*.safetensors"))
    if not files:
        raise NanoEvalError(f"checkpoint {checkpoint} has no model/*.safetensors. Fix: pass a nanotron checkpoint folder.")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        leaf = _SHARD_SUFFIX.sub("", file.stem).removeprefix("model_")
        name = ".".join((*file.parent.relative_to(root).parts, leaf))
        with safe_open(str(file), framework="pt") as f:
            data, meta = f.get_tensor("data"), f.metadata() or {}
        if "unsharded_shape" not in meta:
            weights[name] = data
            continue
        shape = tuple(int(x) for x in NUMPY_SCALAR_REPR.sub(r"\1", meta["unsharded_shape"]).strip("()").split(",") if x.strip())
        full = weights.setdefault(name, torch.empty(shape, dtype=data.dtype))
        for pair in meta["local_global_slices_pairs"].split(";"):
            local, global_ = pair.split("#")
            full[_slices(global_)] = data[_slices(local)]
    return weights


def interleaved_to_half_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's rows [r0, r1, r2, r3, ...] (pairs (r0, r1), (r2, r3)) to [r0, r2, ..., r1, r3, ...]."""
    d = w.shape[0] // heads
    return w.view(heads, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def hf_config_from(model_config: dict):
    from transformers import LlamaConfig

    c = model_config
    return LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
        max_position_embeddings=c["max_position_embeddings"], rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=c.get("rope_theta", 10000.0), hidden_act=c.get("hidden_act", "silu"),
        tie_word_embeddings=c.get("tie_word_embeddings", False), attention_bias=False, mlp_bias=False,
        bos_token_id=c.get("bos_token_id"), eos_token_id=c.get("eos_token_id"), pad_token_id=c.get("pad_token_id"),
    )


def hf_state_dict(weights: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Map nanotron Llama names and layouts to transformers' LlamaForCausalLM."""
    d = config.hidden_size // config.num_attention_heads
    q_rows, kv_rows = config.num_attention_heads * d, config.num_key_value_heads * d
    out = {
        "model.embed_tokens.weight": weights["model.token_position_embeddings.pp_block.token_embedding.weight"],
        "model.norm.weight": weights["model.final_layer_norm.pp_block.weight"],
    }
    if "model.lm_head.pp_block.weight" in weights:
        out["lm_head.weight"] = weights["model.lm_head.pp_block.weight"]
    for i in range(config.num_hidden_layers):
        src, dst = f"model.decoder.{i}.pp_block.", f"model.layers.{i}."
        q, k, v = weights[src + "attn.qkv_proj.weight"].split([q_rows, kv_rows, kv_rows])
        gate, up = weights[src + "mlp.gate_up_proj.weight"].chunk(2)
        out |= {
            dst + "self_attn.q_proj.weight": interleaved_to_half_rotary(q, config.num_attention_heads),
            dst + "self_attn.k_proj.weight": interleaved_to_half_rotary(k, config.num_key_value_heads),
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": weights[src + "attn.o_proj.weight"],
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": weights[src + "mlp.down_proj.weight"],
            dst + "input_layernorm.weight": weights[src + "input_layernorm.weight"],
            dst + "post_attention_layernorm.weight": weights[src + "post_attention_layernorm.weight"],
        }
    return {k: v.contiguous() for k, v in out.items()}


def load_nanotron_llama_as_hf(checkpoint: str | Path, model_config: dict | None = None):
    """A transformers LlamaForCausalLM holding the checkpoint's weights. `model_config` defaults to the
    `model.model_config` section of the checkpoint's config.yaml."""
    if model_config is None:
        model_config = read_model_config(checkpoint)
    try:
        config = hf_config_from(model_config)
    except KeyError as e:
        raise NanoEvalError(f"checkpoint {checkpoint}: config.yaml's model.model_config lacks {e}; is it a Llama?") from e
    return llama_from_state_dict(config, hf_state_dict(read_nanotron_weights(checkpoint), config), f"checkpoint {checkpoint}")


def read_model_config(checkpoint: str | Path) -> dict:
    import yaml

    path = Path(checkpoint) / "config.yaml"
    try:
        return yaml.safe_load(path.read_text())["model"]["model_config"]
    except (OSError, KeyError, TypeError) as e:
        raise NanoEvalError(f"checkpoint {checkpoint}: cannot read model.model_config from {path} ({e}).") from e
