"""The one leaf every Megatron checkpoint reader shares: safe loading of a pickled shard, Megatron's training
arguments as a dict, the size of the model they describe (checked before anything is built), and the transformers
LlamaConfig they describe."""

from __future__ import annotations

import math
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path

from nano_eval.checkpoints.pickles import MEGATRON
from nano_eval.checkpoints.torch_files import load_torch
from nano_eval.checkpoints.untrusted import CheckpointFileError
from nano_eval.errors import NanoEvalError


def load_shard(path: Path, *, offset: int = 0, length: int | None = None, where: str | Path | None = None,
               wrapped_in_list: bool = False) -> dict:
    """One torch.save'd Megatron file (`model_optim_rng.pt`, `common.pt`) as read by nano_eval's own reader
    (checkpoints/torch_files.py + pickles.py: nothing in it is imported or run; enums, numpy RNG state and paths
    stay opaque). offset / length / where: a torch.save archive inside a bigger file (megatron-core 0.19's
    common state in a .distcp file, saved as a list holding the dict: `wrapped_in_list`)."""
    where = where or path
    loaded = load_torch(path, MEGATRON, offset=offset, length=length, where=where)
    if wrapped_in_list:
        if not (isinstance(loaded, list) and len(loaded) == 1):
            raise CheckpointFileError(where, f"holds a {type(loaded).__name__}, not the one-element list "
                                      "megatron-core saves its common state in", "point at a Megatron iter_XXXXXXX "
                                      "folder")
        loaded = loaded[0]
    if not isinstance(loaded, dict):
        raise CheckpointFileError(where, f"holds a {type(loaded).__name__}, not the dict Megatron saves",
                                  "point at a Megatron iter_XXXXXXX folder")
    return loaded


def args_dict(args) -> dict:
    """Megatron's pickled `args` (an argparse.Namespace, a dict or None) as a plain dict."""
    return dict(vars(args)) if isinstance(args, Namespace) else dict(args or {})


LLAMA_STYLE = {"normalization": "RMSNorm", "swiglu": True, "position_embedding_type": "rope", "add_bias_linear": False,
               "add_qkv_bias": False, "qk_layernorm": False, "rotary_percent": 1.0}


def hf_config_from_args(args: Mapping, vocab_size: int):
    """A transformers LlamaConfig from Megatron's training arguments (names as in Megatron-LM's arguments.py)."""
    from transformers import LlamaConfig

    from nano_eval.checkpoints.megatron_config import translate

    wrong = {k: args[k] for k, v in LLAMA_STYLE.items() if k in args and args[k] is not None and args[k] != v}
    if wrong or args.get("use_rope_scaling"):
        raise NanoEvalError(f"not a Llama-style GPT checkpoint: {wrong or {'use_rope_scaling': True}} "
                            f"(the converter needs {LLAMA_STYLE}, no rope scaling).")
    try:
        # names as Megatron-LM reads them; refuses what it cannot build
        model = translate({"padded_vocab_size": vocab_size, **LLAMA_STYLE, **args})
        if model.zero_centered_gamma:
            raise NanoEvalError("not a Llama-style GPT checkpoint: its norms are zero-centred (--apply-layernorm-1p), "
                                "which the transformers converter does not fold. Fix: pass --backend megatron.")
        heads = args["num_attention_heads"]
        groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
        return LlamaConfig(
            vocab_size=vocab_size, hidden_size=args["hidden_size"], intermediate_size=args["ffn_hidden_size"],
            num_hidden_layers=args["num_layers"], num_attention_heads=heads, num_key_value_heads=groups or heads,
            head_dim=args.get("kv_channels") or args["hidden_size"] // heads,
            max_position_embeddings=args.get("max_position_embeddings") or args["seq_length"],
            rms_norm_eps=model.config["layernorm_epsilon"], rope_theta=float(args.get("rotary_base", 10000)),
            tie_word_embeddings=not args.get("untie_embeddings_and_output_weights", False),
            attention_bias=False, mlp_bias=False, hidden_act="silu",
        )
    except KeyError as e:
        raise NanoEvalError(f"the checkpoint's args lack {e}. Fix: pass megatron_args=... (Megatron's names).") from e


_LIMIT = 1 << 40


def model_parameters(args: Mapping, where: str | Path) -> int:
    """An upper bound of the parameters of the GPTModel `args` describe (dense or MoE: every layer counted with the
    larger of its MLPs), from the sizes alone, so that a hostile `padded_vocab_size` is refused before anything is
    allocated. Each size must be a positive integer."""
    def size(name: str, required: bool = True) -> int:
        value = args.get(name)
        if value is None and not required:
            return 0
        if type(value) is not int or not 0 < value < _LIMIT:
            raise CheckpointFileError(where, f"the checkpoint's args say {name}={value!r:.60}, not a positive "
                                      "integer size", "pass the right value with megatron_args=..., or copy the "
                                      "checkpoint again")
        return value

    h, layers, heads, vocab, ffn = (size(n) for n in ("hidden_size", "num_layers", "num_attention_heads",
                                                      "padded_vocab_size", "ffn_hidden_size"))
    groups = size("num_query_groups", False) or heads
    d = size("kv_channels", False) or max(1, h // heads)
    experts = max(size("num_moe_experts", False), size("num_experts", False))  # core's name, Megatron-LM's name
    moe_ffn, shared = (size(n, False) for n in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"))
    positions = max(size("max_position_embeddings", False), size("seq_length", False))
    attention = h * (heads + 2 * groups) * d + heads * d * h + 2 * h + 2 * d
    dense = 3 * h * ffn
    moe = experts * (3 * h * (moe_ffn or ffn) + h) + 3 * h * shared
    learned = positions * h if args.get("position_embedding_type") == "learned_absolute" else 0
    return vocab * h * 2 + layers * (attention + max(dense, moe)) + h + learned


def check_arg_values(args: Mapping, where: str | Path) -> None:
    """Refuse, naming the argument, a value that can only give NaN or meaningless logits: a rotary base that is not
    a finite number > 0 (0 gives infinite rotary frequencies; megatron-core would even take 0 for its default), a
    norm epsilon that is negative or not finite. (The weights are checked when scored: nano_eval.finite.)"""
    for name, positive in (("rotary_base", True), ("norm_epsilon", False)):
        value = args.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise CheckpointFileError(where, f"the checkpoint's args set {name}={value}, but it must be a finite "
                                      f"number {'>' if positive else '>='} 0 (the model would give NaN or "
                                      "meaningless logits)", f"pass megatron_args={{'{name}': <the value the "
                                      "model was trained with>}}, or restore the checkpoint")


def check_model_size(args: Mapping, where: str | Path, *, disk_bytes: int, policy) -> int:
    """Refuse a model that `args` make larger than the checkpoint's files (a parameter takes at least one byte on
    disk) or than the policy's allocation limit; returns the parameter bound."""
    import torch

    check_arg_values(args, where)
    params = model_parameters(args, where)
    dtype = args.get("params_dtype") if isinstance(args.get("params_dtype"), torch.dtype) else torch.float32
    if params > 2 * disk_bytes + (1 << 20):  # untied output layer counted even when tied: a factor of 2 of slack
        raise CheckpointFileError(where, f"the checkpoint's args describe a model of {params:,} parameters but its "
                                  f"files hold only {disk_bytes:,} bytes")
    policy.check_allocation(params * max(4, dtype.itemsize), where, f"a model of {params:,} parameters")
    return params
