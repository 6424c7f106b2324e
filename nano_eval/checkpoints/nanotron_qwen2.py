"""nanotron main's Qwen2 (the SmolLM3 code) into transformers' SmolLM3ForCausalLM, for what a Llama cannot express.

A dense nanotron Qwen2 without the fields below is a Llama (nano_eval.checkpoints.nanotron converts it as one).
transformers' SmolLM3 is a Llama with three per-model switches that match nanotron main's Qwen2 exactly:
- `no_rope_layer: k` (nanotron skips RoPE in layer i when (i + 1) % k == 0) -> `no_rope_layers[i] = 0` there;
- `attention_bias: true` (nanotron: a bias on the fused q/k/v projection, none on o_proj) -> SmolLM3's
  `attention_bias` (q, k, v AND o biases): q/k/v biases split from nanotron's, o_proj's bias all zeros;
- `sliding_window_size: w` (nanotron: flash-attn window (w - 1, 0), i.e. each token sees itself and the w - 1 before
  it; nanotron turns the window OFF in its no-RoPE layers) -> `sliding_window: w` on the RoPE layers
  (`layer_types` "sliding_attention"), full attention on the no-RoPE layers.
The weights are the Llama conversion's plus the biases. Everything else nanotron reads that changes the numbers
(MoE, interpolated RoPE positions, a flex-attention mask) stays refused (nano_eval.checkpoints.nanotron).
"""

from __future__ import annotations

import torch

SMOLLM3_FIELDS = ("no_rope_layer", "attention_bias", "sliding_window_size")


def needs_smollm3(model_config: dict) -> bool:
    """Whether a Qwen2 model_config uses a feature only the SmolLM3 conversion reproduces."""
    return bool(model_config.get("is_qwen2_config")) and any(
        model_config.get(k) not in (None, False) for k in SMOLLM3_FIELDS)


def smollm3_config_from(model_config: dict, llama_config):
    """SmolLM3Config with the Llama conversion's sizes (`llama_config`) and the Qwen2 switches above."""
    from transformers import SmolLM3Config

    layers = llama_config.num_hidden_layers
    k = model_config.get("no_rope_layer")
    use_rope = [int(not k or (i + 1) % k != 0) for i in range(layers)]
    window = model_config.get("sliding_window_size")
    c = llama_config
    return SmolLM3Config(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_theta=model_config.get("rope_theta", 10000.0), hidden_act=c.hidden_act,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=bool(model_config.get("attention_bias")),
        mlp_bias=False, no_rope_layers=use_rope, no_rope_layer_interval=k or layers + 1,
        use_sliding_window=window is not None, sliding_window=window,
        layer_types=["sliding_attention" if window is not None and rope else "full_attention" for rope in use_rope],
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
    )


def add_attention_biases(state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], config,
                         rotary) -> dict[str, torch.Tensor]:
    """`state` (the Llama conversion's) plus SmolLM3's q/k/v biases from nanotron's fused qkv bias (q and k rows
    reordered by `rotary`, as their weights) and zero o_proj biases; unchanged without `config.attention_bias`."""
    if not config.attention_bias:
        return state
    d = config.hidden_size // config.num_attention_heads
    q_rows, kv_rows = config.num_attention_heads * d, config.num_key_value_heads * d
    out = dict(state)
    for i in range(config.num_hidden_layers):
        src, dst = f"model.decoder.{i}.pp_block.attn.", f"model.layers.{i}.self_attn."
        q, k, v = weights[src + "qkv_proj.bias"].split([q_rows, kv_rows, kv_rows])
        out |= {
            dst + "q_proj.bias": rotary(q.unsqueeze(1), config.num_attention_heads).squeeze(1).contiguous(),
            dst + "k_proj.bias": rotary(k.unsqueeze(1), config.num_key_value_heads).squeeze(1).contiguous(),
            dst + "v_proj.bias": v.contiguous(),
            dst + "o_proj.bias": torch.zeros(config.hidden_size, dtype=v.dtype),
        }
    return out
