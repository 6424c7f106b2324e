"""megatron-core's GPTModel from the training arguments a Megatron checkpoint pickles (Megatron-LM's names).

Both Megatron readers build the model this way: the torch_dist -> transformers converter at TP1/PP1
(megatron_dist.py) and the native backend in any TP x PP x EP layout (megatron_native.py). Like Megatron-LM's own
`core_transformer_config_from_args`, the architecture comes from the args; unlike it, only a fixed list of
architecture fields is taken (the args are untrusted: plain values only), and everything about the run (parallel
sizes, fusions that need compiled kernels, dropout, recomputation) is set for evaluation on this machine.

The layer spec is megatron-core's local one (no Transformer Engine needed): its sharded state dict names every
weight as the Transformer Engine spec does, so checkpoints of either spec load. MoE layers use `SequentialMLP`
(no grouped GEMM); `moe_layer_freq` decides which layers are MoE, as in training.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from nano_eval.errors import NanoEvalError

# TransformerConfig fields copied from the args when present (plain values only)
ARCHITECTURE = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "add_bias_linear",
    "add_qkv_bias", "qk_layernorm", "rotary_interleaved", "normalization", "apply_residual_connection_post_layernorm",
    "layernorm_zero_centered_gamma", "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "window_size",
    "num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_router_load_balancing_type", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
    "moe_router_dtype", "moe_token_dispatcher_type", "moe_layer_freq", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    "moe_router_topk_limited_devices", "moe_apply_probs_on_input",
)
_PLAIN = (bool, int, float, str, type(None))


def _plain(value) -> bool:
    return isinstance(value, _PLAIN) or (isinstance(value, (list, tuple)) and all(type(v) is int for v in value))


def transformer_config(args: Mapping, *, tp: int, pp: int, ep: int = 1, dtype: torch.dtype | None = None):
    """TransformerConfig of the model `args` describe, for evaluation at tp x pp x ep (cp 1, no sequence
    parallelism); weights are not initialised (the checkpoint overwrites them)."""
    import torch.nn.functional as F
    from dataclasses import fields

    from megatron.core.transformer import TransformerConfig

    known = {f.name for f in fields(TransformerConfig)}
    kwargs = {k: args[k] for k in ARCHITECTURE if k in known and k in args and args[k] is not None and _plain(args[k])}
    heads = args["num_attention_heads"]
    if "num_moe_experts" not in kwargs and type(args.get("num_experts")) is int:  # Megatron-LM's --num-experts
        kwargs["num_moe_experts"] = args["num_experts"]
    kwargs.setdefault("normalization", "LayerNorm")
    if args.get("group_query_attention") and args.get("num_query_groups"):
        kwargs["num_query_groups"] = args["num_query_groups"]
    kwargs["kv_channels"] = kwargs.get("kv_channels") or args["hidden_size"] // heads
    kwargs["layernorm_epsilon"] = float(args.get("norm_epsilon", 1e-5))
    if args.get("swiglu"):
        kwargs.update(gated_linear_unit=True, activation_func=F.silu)
    elif args.get("squared_relu"):
        kwargs.update(activation_func=lambda x: F.relu(x) ** 2)
    else:
        kwargs.update(activation_func=F.gelu)
    if dtype is None:
        dtype = args.get("params_dtype") if isinstance(args.get("params_dtype"), torch.dtype) else torch.float32
    return TransformerConfig(
        **kwargs, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        context_parallel_size=1, sequence_parallel=False, params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        moe_grouped_gemm=False, moe_permute_fusion=False, use_cpu_initialization=True, perform_initialization=False)


def build_gpt_model(args: Mapping, *, tp: int | None = None, pp: int | None = None, ep: int | None = None,
                    dtype: torch.dtype | None = None):
    """This rank's GPTModel stage in the current parallel_state (sizes default to it); at TP1/PP1, the whole
    model."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    tp = tp or ps.get_tensor_model_parallel_world_size()
    pp = pp or ps.get_pipeline_model_parallel_world_size()
    ep = ep or ps.get_expert_model_parallel_world_size()
    try:
        config = transformer_config(args, tp=tp, pp=pp, ep=ep, dtype=dtype)
        if config.num_moe_experts:
            spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                              normalization=config.normalization)
        else:
            spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
        position = args.get("position_embedding_type") or "learned_absolute"
        return GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=args["padded_vocab_size"],
            max_sequence_length=args.get("max_position_embeddings") or args["seq_length"],
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not args.get("untie_embeddings_and_output_weights", False),
            position_embedding_type=position, rotary_percent=float(args.get("rotary_percent") or 1.0),
            rotary_base=int(args.get("rotary_base") or 10000), rope_scaling=bool(args.get("use_rope_scaling")),
            rope_scaling_factor=float(args.get("rope_scaling_factor") or 8.0))
    except KeyError as e:
        raise NanoEvalError(f"the checkpoint's args lack {e}. Fix: pass megatron_args=... (Megatron's names).") from e
