"""Megatron-LM's training arguments -> the megatron-core model Megatron-LM built from them.

A checkpoint pickles Megatron-LM's `args` (argparse names), not a TransformerConfig. Megatron-LM turns them into the
model in `core_transformer_config_from_args` (megatron/training/arguments.py) and its GPT builder (gpt_builders.py /
megatron/training/models/gpt.py): most TransformerConfig fields share the argument's name, but not all, and some
arguments change the math without any field of that name. Weight shapes do not show them, so a loader that copied
only same-named fields would load every weight and score wrongly, silently. `translate` reads every argument that
changes the model's math and either applies it as Megatron-LM does or refuses it by name (`UnsupportedArgument`:
one line naming the argument and the fix):

- renamed: `--apply-layernorm-1p` (`apply_layernorm_1p` up to core 0.15, `layernorm_zero_centered_gamma` from 0.16)
  -> zero-centred norm weights, `--norm-epsilon` (`norm_epsilon` / `layernorm_epsilon`) -> layernorm_epsilon,
  `--num-experts` -> num_moe_experts, `--group-query-attention` + `--num-query-groups` -> num_query_groups (None
  without the switch, whatever num_query_groups says), `--untie-embeddings-and-output-weights` -> GPTModel's
  share_embeddings_and_output_weights;
- derived: `--swiglu` -> gated_linear_unit + silu, `--squared-relu` -> squared ReLU, `--quick-geglu` -> gated +
  quick GELU, otherwise GELU; kv_channels defaults to hidden / heads;
- GPTModel's own: position_embedding_type, rotary_base, rotary_percent, use_rope_scaling (Megatron-LM passes no
  factor: GPTModel's 8.0 is what trained), max_position_embeddings, padded_vocab_size;
- same name: normalization (LayerNorm / RMSNorm), qk_layernorm, qk_l2_norm, add_bias_linear, add_qkv_bias,
  rotary_interleaved, the attention options and every MoE router / expert option in SAME_NAME.
Refused: what the local layer spec cannot build (MLA, hybrid / heterogeneous / experimental-attention models, a
custom --spec, YAML configs, legacy models, yarn / mrope / relative positions, other norms, latent MoE; core 0.19's
maximal-update parameterisation, block-interleaved GLU experts and forced router bias) and what
Megatron-LM's builders disagree on (`rotary_seq_len_interpolation_factor`: its GPT builder ignores it, its
GPTModelConfig applies it; `rope_scaling_factor` other than the 8.0 GPTModel always received).
Missing arguments take Megatron-LM's defaults (DEFAULTS; the tests check them against upstream's arguments.py).
Everything about the run (parallel sizes, fusions, dropout, recomputation, precision recipes) is the evaluator's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from nano_eval.errors import NanoEvalError

# Megatron-LM's defaults (core_v0.16.1's and core_v0.19.0's arguments.py and the TransformerConfig fields they turn
# into arguments) for every argument read here; tests/test_megatron_args.py checks them against
# tests/megatron_lm_defaults.json
DEFAULTS = {
    "kv_channels": None, "group_query_attention": False, "num_query_groups": 1,
    "untie_embeddings_and_output_weights": False, "normalization": "LayerNorm", "layernorm_epsilon": 1e-05,
    "layernorm_zero_centered_gamma": False, "qk_layernorm": False, "qk_l2_norm": False, "swiglu": False,
    "squared_relu": False, "quick_geglu": False, "add_bias_linear": True, "add_qkv_bias": False,
    "position_embedding_type": "learned_absolute", "rotary_base": 10000, "rotary_percent": 1.0,
    "rotary_interleaved": False, "rotary_seq_len_interpolation_factor": None, "use_rope_scaling": False,
    "rope_scaling_factor": 8.0, "multi_latent_attention": False, "experimental_attention_variant": None,
    "num_experts": None, "moe_latent_size": None, "heterogeneous_layers_config_path": None,
    "use_legacy_models": False, "spec": None, "yaml_cfg": None, "hybrid_override_pattern": None,
    "is_hybrid_model": False, "mtp_num_layers": None,
    # core 0.19 (the names do not exist before; a checkpoint of an older run lacks them and takes these)
    "use_mup": False, "moe_mlp_glu_interleave_size": None, "moe_shared_expert_glu_interleave_size": None,
    "moe_router_force_biased": None,
}

# TransformerConfig fields that are Megatron-LM arguments of the same name (copied when plain values)
SAME_NAME = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "add_bias_linear", "add_qkv_bias",
    "qk_layernorm", "qk_l2_norm", "rotary_interleaved", "normalization", "apply_residual_connection_post_layernorm",
    "fp32_residual_connection", "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "window_size",
    "window_attn_skip_freq", "no_rope_freq", "softmax_type", "attention_output_gate", "glu_linear_offset",
    "activation_func_clamp_value",
    "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
    "moe_router_load_balancing_type", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "moe_router_dtype", "moe_token_dispatcher_type", "moe_layer_freq",
    "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity",
    "moe_token_drop_policy", "moe_router_topk_limited_devices", "moe_apply_probs_on_input",
)
# the names Megatron-LM up to core 0.15 pickled (its core_transformer_config_from_args renamed them); 0.16's
# arguments carry the field names themselves
RENAMED_BEFORE_0_16 = {"apply_layernorm_1p": "layernorm_zero_centered_gamma", "norm_epsilon": "layernorm_epsilon"}
POSITIONS = ("learned_absolute", "rope", "none")
NORMS = ("LayerNorm", "RMSNorm")
TRAINED_ROPE_SCALING_FACTOR = 8.0  # GPTModel's default: no Megatron-LM builder passes --rope-scaling-factor
_PLAIN = (bool, int, float, str, type(None))
_FIX = ("score the run's live model with the training hook (nano_eval.training.megatron), which evaluates whatever "
        "Megatron-LM built")


class UnsupportedArgument(NanoEvalError):
    """A training argument that changes the model's math and that this loader cannot build as Megatron-LM did."""

    def __init__(self, name: str, value, why: str, fix: str = _FIX):
        self.argument = name
        super().__init__(f"the checkpoint's Megatron-LM argument {name}={value!r:.80} is not supported by "
                         f"--backend megatron: {why}. Fix: {fix}.")


@dataclass
class ModelArgs:
    """What Megatron-LM built from the args: TransformerConfig fields (the architecture only), GPTModel keywords,
    the layer spec's options, and whether norm weights are stored zero-centred (`--apply-layernorm-1p`)."""

    config: dict = field(default_factory=dict)
    gpt: dict = field(default_factory=dict)
    spec: dict = field(default_factory=dict)
    zero_centered_gamma: bool = False
    mtp_layers: int = 0


def value(args: Mapping, name: str):
    """The argument as Megatron-LM had it: the pickled value, or Megatron-LM's default when the args lack it."""
    return args[name] if name in args else DEFAULTS.get(name)


def _plain(v) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, (list, tuple)) and all(type(x) is int for x in v))


def refuse_unsupported(args: Mapping) -> None:
    """Raise UnsupportedArgument for the first argument this loader cannot build as Megatron-LM did."""
    def unless(name, ok, why, fix=_FIX):
        v = value(args, name)
        if not ok(v):
            raise UnsupportedArgument(name, v, why, fix)

    unless("use_legacy_models", lambda v: not v, "the legacy (non-core) GPTModel has other weights and layers")
    unless("multi_latent_attention", lambda v: not v, "multi-latent attention is not built by the local layer spec")
    unless("experimental_attention_variant", lambda v: v is None, "experimental attention variants are not built")
    for name in ("heterogeneous_layers_config_path", "heterogeneous_layers_config_encoded_json",
                 "hybrid_override_pattern", "hybrid_layer_pattern"):
        unless(name, lambda v: v is None, "only homogeneous GPT decoders are built")
    unless("is_hybrid_model", lambda v: not v, "only GPT decoders are built (no Mamba / hybrid layers)")
    unless("spec", lambda v: v is None, "the run built its layers from its own spec module, which nano_eval "
           "does not import (a checkpoint must not choose code to run)")
    unless("yaml_cfg", lambda v: v is None, "the run's model came from a YAML config, not from these args")
    unless("position_embedding_type", lambda v: v in POSITIONS, f"only {', '.join(POSITIONS)} positions are built")
    unless("normalization", lambda v: v in NORMS, f"only {' and '.join(NORMS)} are built")
    unless("moe_latent_size", lambda v: v is None, "latent MoE projections are not built")
    # core 0.19's
    unless("use_mup", lambda v: not v, "maximal-update parameterisation scales embeddings, attention and logits, "
           "which this loader does not build")
    for name in ("moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size"):
        unless(name, lambda v: v is None, "block-interleaved GLU weights are not read")
    unless("moe_router_force_biased", lambda v: v is None, "the run added random bias to its router logits")
    unless("rotary_seq_len_interpolation_factor", lambda v: v is None or (type(v) in (int, float) and v == 1),
           "Megatron-LM's gpt_builders.py never passes it to GPTModel while its GPTModelConfig (newer pretrain_gpt.py) "
           "does, and the checkpoint does not say which built the model",
           "re-save the args with rotary_seq_len_interpolation_factor=None if the run ignored it, or score the live "
           "model with the training hook (nano_eval.training.megatron)")
    if value(args, "use_rope_scaling"):
        unless("rope_scaling_factor", lambda v: type(v) in (int, float) and v == TRAINED_ROPE_SCALING_FACTOR,
               f"no Megatron-LM builder passes it: GPTModel trained with its default "
               f"{TRAINED_ROPE_SCALING_FACTOR}", f"re-save the args with rope_scaling_factor="
               f"{TRAINED_ROPE_SCALING_FACTOR} if the run was Megatron-LM's, or score the live model with the "
               "training hook (nano_eval.training.megatron)")


def translate(args: Mapping) -> ModelArgs:
    """The model Megatron-LM built from `args` (see the module docstring), or UnsupportedArgument."""
    import torch.nn.functional as F

    refuse_unsupported(args)
    out = ModelArgs()
    out.config = {k: args[k] for k in SAME_NAME if k in args and args[k] is not None and _plain(args[k])}
    out.config.setdefault("normalization", DEFAULTS["normalization"])
    out.config.setdefault("add_bias_linear", DEFAULTS["add_bias_linear"])
    experts = value(args, "num_experts")
    if experts is None and type(args.get("num_moe_experts")) is int:  # args written with megatron-core's name
        experts = args["num_moe_experts"]
    if experts:
        out.config["num_moe_experts"] = experts
        out.config.setdefault("moe_ffn_hidden_size", args.get("ffn_hidden_size"))  # validate_args' default
    heads = args["num_attention_heads"]
    out.config["num_query_groups"] = args.get("num_query_groups") if value(args, "group_query_attention") else None
    out.config["kv_channels"] = value(args, "kv_channels") or args["hidden_size"] // heads
    # renamed in core 0.16: the old names, where present, are what that Megatron-LM applied
    renamed = {new: args[old] for old, new in RENAMED_BEFORE_0_16.items() if old in args}
    out.config["layernorm_epsilon"] = float(renamed.get("layernorm_epsilon", value(args, "layernorm_epsilon")))
    out.zero_centered_gamma = bool(renamed.get("layernorm_zero_centered_gamma",
                                               value(args, "layernorm_zero_centered_gamma")))
    out.config["layernorm_zero_centered_gamma"] = False  # megatron's torch norms refuse it: folded into the weights
    if value(args, "swiglu"):
        out.config.update(gated_linear_unit=True, activation_func=F.silu)
    elif value(args, "squared_relu"):
        from megatron.core.activations import squared_relu

        out.config.update(activation_func=squared_relu)
    elif value(args, "quick_geglu"):
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        out.config.update(gated_linear_unit=True, activation_func=quick_gelu)
    else:
        out.config.update(activation_func=F.gelu)
    out.spec = {"normalization": out.config["normalization"], "qk_l2_norm": bool(value(args, "qk_l2_norm")),
                "qk_layernorm": bool(value(args, "qk_layernorm"))}
    out.gpt = {
        "vocab_size": args["padded_vocab_size"],
        "max_sequence_length": args.get("max_position_embeddings") or args["seq_length"],
        "share_embeddings_and_output_weights": not value(args, "untie_embeddings_and_output_weights"),
        "position_embedding_type": value(args, "position_embedding_type"),
        "rotary_percent": float(value(args, "rotary_percent")), "rotary_base": int(value(args, "rotary_base")),
        "rope_scaling": bool(value(args, "use_rope_scaling")),
    }
    out.mtp_layers = int(value(args, "mtp_num_layers") or 0)
    return out


def unfold_zero_centered_gamma(model) -> int:
    """`--apply-layernorm-1p`: the run's norms computed norm(x) * (1 + w) from stored w; megatron-core's torch norms
    compute norm(x) * w. Adding 1 to every norm weight after loading gives the same function. Returns the number of
    norm weights changed."""
    import torch

    norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))
             and getattr(m, "weight", None) is not None]
    with torch.no_grad():
        for m in norms:
            m.weight.add_(1.0)
    return len(norms)
