"""Write tests/megatron_lm_defaults.json: Megatron-LM's own defaults for the training arguments that change a GPT
model's math, read from Megatron-LM's source (never run, never imported), so the tests build their args namespaces
from upstream's defaults instead of a hand-written subset.

    git clone https://github.com/NVIDIA/Megatron-LM && python scripts/megatron_lm_defaults.py Megatron-LM

(megatron-core 0.19.2 has no tag of its own; the megatron-core wheel ships Megatron-LM's `megatron/training` from 0.17
on, and 0.19.2's arguments.py, transformer_config.py and model_parallel_config.py are core_v0.19.0's, which
tests/test_megatron_args.py checks against the installed wheel where that is 0.19.)

For each release in RELEASES, the tag's `megatron/training/arguments.py` is parsed with `ast`:
- every `add_argument(...)` call gives its `dest` (or the name from its first `--flag`) and its default
  (`store_true` -> False, `store_false` -> True, `default=<literal>`, None otherwise);
- where the file builds arguments from megatron-core's TransformerConfig (`ArgumentGroupFactory(TransformerConfig,
  exclude=[...])`, releases from core 0.16 on), every field of that tag's `transformer_config.py` and
  `model_parallel_config.py` outside the exclude list is an argument whose default is the field's (a literal), as the
  factory derives it (a field's `argparse_meta` default wins; its `arg_names` change only the flag, e.g.
  `--apply-layernorm-1p` stores into `layernorm_zero_centered_gamma` from core 0.16 on).
Only the names in MODEL_MATH are written (the arguments nano_eval's loader reads, applies or refuses), each release
with the commit it was read from. The JSON is data for the tests; CI needs no network.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

# the last with --apply-layernorm-1p / --norm-epsilon; the main environment's; the newest (CI's .venv-mc19: 0.19.2)
RELEASES = ("core_v0.15.3", "core_v0.16.1", "core_v0.19.0")
ARGUMENTS, CONFIGS = "megatron/training/arguments.py", (
    ("megatron/core/model_parallel_config.py", "ModelParallelConfig"),
    ("megatron/core/transformer/transformer_config.py", "TransformerConfig"))
OUT = Path(__file__).resolve().parents[1] / "tests" / "megatron_lm_defaults.json"
MODEL_MATH = (
    # sizes and layout of the network
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "group_query_attention",
    "num_query_groups", "max_position_embeddings", "seq_length", "untie_embeddings_and_output_weights",
    # normalization
    "normalization", "norm_epsilon", "layernorm_epsilon", "apply_layernorm_1p", "layernorm_zero_centered_gamma",
    "apply_residual_connection_post_layernorm", "qk_layernorm", "qk_l2_norm",
    # activations and biases
    "swiglu", "squared_relu", "quick_geglu", "openai_gelu", "glu_linear_offset", "activation_func_clamp_value",
    "add_bias_linear", "add_qkv_bias",
    # positions
    "position_embedding_type", "add_position_embedding", "use_rotary_position_embeddings", "rotary_base",
    "rotary_percent", "rotary_interleaved", "rotary_seq_len_interpolation_factor", "use_rope_scaling",
    "rope_scaling_factor", "no_rope_freq", "mrope_section",
    # attention
    "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "window_size", "window_attn_skip_freq",
    "softmax_type", "attention_output_gate", "multi_latent_attention", "experimental_attention_variant",
    "fp32_residual_connection",
    # mixture of experts
    "num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor", "moe_router_num_groups", "moe_router_group_topk",
    "moe_router_enable_expert_bias", "moe_router_dtype", "moe_router_load_balancing_type",
    "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_layer_freq", "moe_grouped_gemm",
    "moe_apply_probs_on_input", "moe_latent_size", "moe_token_dispatcher_type", "moe_expert_capacity_factor",
    "moe_pad_expert_input_to_capacity", "moe_input_jitter_eps",
    # core 0.19's
    "use_mup", "moe_mlp_glu_interleave_size", "moe_shared_expert_glu_interleave_size", "moe_router_force_biased",
    # whole-model switches
    "mtp_num_layers", "heterogeneous_layers_config_path", "use_legacy_models", "spec", "yaml_cfg",
    "hybrid_override_pattern", "is_hybrid_model", "transformer_impl",
)


def _literal(node):
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        return None  # a call or a name: not a plain default (none of MODEL_MATH's is one)


def _git_show(repo: Path, tag: str, path: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "show", f"{tag}:{path}"], check=True, capture_output=True,
                          text=True).stdout


def _cli_defaults(tree: ast.AST) -> dict:
    out = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        kw = {k.arg: k.value for k in node.keywords}
        dest = _literal(kw["dest"]) if "dest" in kw else (flags[0].lstrip("-").replace("-", "_") if flags else None)
        if dest is None:
            continue
        action = _literal(kw["action"]) if "action" in kw else None
        if "default" in kw:
            value = _literal(kw["default"])
        else:
            value = {"store_true": False, "store_false": True}.get(action)
        out.setdefault(dest, value)
    return out


def _factory_excludes(tree: ast.AST) -> list[str] | None:
    """The exclude list of `ArgumentGroupFactory(TransformerConfig, exclude=...)`, None where there is none."""
    for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and getattr(n.func, "id", None)
                 == "ArgumentGroupFactory" and n.args and getattr(n.args[0], "id", None) == "TransformerConfig"]
        if calls:
            names = {}
            for n in ast.walk(func):
                if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name):
                    names[n.targets[0].id] = n.value
            exclude = next(k.value for k in calls[0].keywords if k.arg == "exclude")
            return _literal(names[exclude.id] if isinstance(exclude, ast.Name) else exclude)
    return None


def _dataclass_defaults(source: str, cls: str) -> dict:
    tree = ast.parse(source)
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            out[item.target.id] = _field_default(item.value)
    return out


def _field_default(value):
    """A field's default as the argument factory sees it: `x = literal`, or `x = field(default=literal,
    metadata={"argparse_meta": {"default": override, ...}})` (the override wins)."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        kw = {k.arg: k.value for k in value.keywords}
        meta = _literal(kw["metadata"]) if "metadata" in kw else None
        argparse_meta = (meta or {}).get("argparse_meta") or {}
        if "default" in argparse_meta:
            return argparse_meta["default"]
        return _literal(kw["default"]) if "default" in kw else None
    return _literal(value)


def release_defaults(repo: Path, tag: str) -> dict:
    commit = subprocess.run(["git", "-C", str(repo), "rev-list", "-n", "1", tag], check=True, capture_output=True,
                            text=True).stdout.strip()
    source, defaults = model_math_defaults(lambda path: _git_show(repo, tag, path))
    return {"source": f"NVIDIA/Megatron-LM {tag} ({commit}): {source}", "defaults": defaults}


def model_math_defaults(read) -> tuple[str, dict]:
    """(which files, {argument: default} for MODEL_MATH) of one release; read(path in the repository) -> text."""
    args_tree = ast.parse(read(ARGUMENTS))
    defaults = {}
    exclude = _factory_excludes(args_tree)
    if exclude is not None:
        for path, cls in CONFIGS:
            fields = _dataclass_defaults(read(path), cls)
            defaults.update({k: v for k, v in fields.items() if k not in exclude})
    defaults.update(_cli_defaults(args_tree))
    return (ARGUMENTS + (" + TransformerConfig fields" if exclude is not None else ""),
            {k: defaults[k] for k in MODEL_MATH if k in defaults})


def main(repo: str) -> None:
    data = {tag: release_defaults(Path(repo), tag) for tag in RELEASES}
    OUT.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"wrote {OUT}: " + ", ".join(f"{t}: {len(d['defaults'])} arguments" for t, d in data.items()))


if __name__ == "__main__":
    main(sys.argv[1])
