"""The one leaf every Megatron checkpoint reader shares: safe loading of a pickled shard, Megatron's training
arguments as a dict, and the transformers LlamaConfig they describe."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path

import torch

from nano_eval.errors import NanoEvalError


def _safe_globals() -> list:
    """What a legacy checkpoint pickles besides tensors: Megatron's args (argparse.Namespace, with a few enums and
    paths), and numpy arrays in the RNG state. With megatron-core installed, its own allow-list (the classes
    Megatron itself loads with weights_only=True); never weights_only=False."""
    import pathlib
    import types

    allowed = [Namespace, types.SimpleNamespace, pathlib.PosixPath]
    try:
        import numpy as np

        allowed += [np.ndarray, np.dtype, np.dtypes.UInt32DType, np.core.multiarray._reconstruct]
    except (ImportError, AttributeError):
        pass
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS

        allowed += [g for g in SAFE_GLOBALS if g not in allowed]
    except ImportError:
        pass
    return allowed


def load_shard(path: Path) -> dict:
    """One `model_optim_rng.pt`, loaded with weights_only=True and a minimal allow-list of globals."""
    import pickle

    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise NanoEvalError(
            f"{path}: cannot be loaded safely (weights_only=True): {str(e).splitlines()[0]} Fix: install "
            "megatron-core (its enums are in the allow-list) or save with --no-save-optim --no-save-rng."
        ) from e


def args_dict(args) -> dict:
    """Megatron's pickled `args` (an argparse.Namespace, a dict or None) as a plain dict."""
    return dict(vars(args)) if isinstance(args, Namespace) else dict(args or {})


LLAMA_STYLE = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "add_bias_linear": False,
               "add_qkv_bias": False, "qk_layernorm": False, "rotary_percent": 1.0}


def hf_config_from_args(args: Mapping, vocab_size: int):
    """A transformers LlamaConfig from Megatron's training arguments (names as in Megatron-LM's arguments.py)."""
    from transformers import LlamaConfig

    wrong = {k: args[k] for k, v in LLAMA_STYLE.items() if k in args and args[k] is not None and args[k] != v}
    if wrong or args.get("use_rope_scaling"):
        raise NanoEvalError(f"not a Llama-style GPT checkpoint: {wrong or {'use_rope_scaling': True}} "
                            f"(the converter needs {LLAMA_STYLE}, no rope scaling).")
    try:
        heads = args["num_attention_heads"]
        groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=args["hidden_size"], intermediate_size=args["ffn_hidden_size"],
            num_hidden_layers=args["num_layers"], num_attention_heads=heads, num_key_value_heads=groups or heads,
            head_dim=args.get("kv_channels") or args["hidden_size"] // heads,
            max_position_embeddings=args.get("max_position_embeddings") or args["seq_length"],
            rms_norm_eps=args.get("norm_epsilon", 1e-5), rope_theta=float(args.get("rotary_base", 10000)),
            tie_word_embeddings=not args.get("untie_embeddings_and_output_weights", False),
            attention_bias=False, mlp_bias=False, hidden_act="silu",
        )
    except KeyError as e:
        raise NanoEvalError(f"the checkpoint's args lack {e}. Fix: pass megatron_args=... (Megatron's names).") from e
