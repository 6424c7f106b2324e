"""Read a Megatron Llama-style GPT checkpoint (any TP x PP) into transformers' LlamaForCausalLM.

So a Megatron checkpoint can be scored without Megatron-LM, a GPU or a process group: `--checkpoint <iter_XXXXXXX
folder or run dir> --tokenizer T`. A run dir (holding `latest_checkpointed_iteration.txt`) resolves to its latest
`iter_%07d` folder, as Megatron's loader does. Megatron does not store the tokenizer with the weights, so a tokenizer
is required. Inside a training job, score the live model with nano_eval.backends.megatron.MegatronModel instead.

The legacy layout:
`iter_0001000/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`, each a dict with `model` (that rank's GPTModel
state dict), `args` (Megatron's argparse.Namespace), `iteration`, and optimizer / RNG state we do not need.

What differs from transformers' Llama, and how we undo it:
- TP shards: column-parallel weights (embedding, linear_qkv, linear_fc1, output_layer) are split by rows, row-parallel
  ones (linear_proj, linear_fc2) by columns; norms are replicated.
- `linear_qkv` rows are grouped per query group: for each group g, [its q heads | k_g | v_g] (TP splits whole groups).
- `linear_fc1` (swiglu) holds [gate shard | up shard] on each TP rank, so it is un-fused shard by shard.
- PP stages number their layers from 0; stage p's layers follow stage p-1's.
- norms fused into the next linear (Transformer Engine spec) are saved as `linear_qkv.layer_norm_weight` /
  `linear_fc1.layer_norm_weight`; the local spec saves `input_layernorm.weight` / `pre_mlp_layernorm.weight`.
- RoPE rotates halves by default, as transformers does; `rotary_interleaved=True` checkpoints get their q/k rows
  permuted per head.
The vocabulary stays padded (`padded_vocab_size` rows), as Megatron's own softmax sees it.
A torch_dist checkpoint (`*.distcp`, `.metadata`, `common.pt`) is first loaded by megatron-core into one TP1 GPTModel
(megatron_dist.py), whose state dict then takes the path of a one-shard legacy checkpoint.
"""

from __future__ import annotations

import os
import re
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path

import torch

from nano_eval.checkpoints.llama import interleaved_to_half_rotary, llama_from_state_dict
from nano_eval.checkpoints.megatron_args import args_dict, hf_config_from_args, load_shard
from nano_eval.checkpoints.megatron_dist import is_dist_checkpoint, read_dist_checkpoint
from nano_eval.checkpoints.untrusted import CheckpointFileError, FilePolicy, Folder
from nano_eval.errors import NanoEvalError

SHARD_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
COLUMN_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight", "linear_qkv.weight")
ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
TRACKER = "latest_checkpointed_iteration.txt"
ITER_DIR = re.compile(r"^(iter_\d{7}|release)$")


def shard_files(folder: Folder, allow_expert_shards: bool = False) -> dict[tuple, Path]:
    """{(tp_rank, pp_rank): model_optim_rng.pt} of a legacy iteration folder (checked); no shard may be missing.
    allow_expert_shards: keys are (tp_rank, pp_rank, ep_rank), and `mp_rank_TT_PPP_EEE` folders are read (the
    native backend); otherwise they are refused (the transformers conversion is for dense models)."""
    iter_dir = folder.root
    found: dict[tuple[int, int, int], Path] = {}
    for sub in sorted(p for p in iter_dir.iterdir() if p.is_dir()):
        m = SHARD_DIR.match(sub.name)
        if not m:
            continue
        if m.group(3) is not None and not allow_expert_shards:
            raise NanoEvalError(f"{sub}: expert-parallel shards convert to transformers only for dense models. Fix: "
                                "score it with --backend megatron --tp T --pp P --ep E (its saved layout).")
        found[(int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0))] = sub / "model_optim_rng.pt"
    if not found:
        raise NanoEvalError(f"{iter_dir} holds no mp_rank_XX folders. Fix: pass a Megatron iter_* folder.")
    tp, pp, ep = (max(k[i] for k in found) + 1 for i in range(3))
    missing = [f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 or ep > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
               for t in range(tp) for p in range(pp) for e in range(ep)
               if not found.get((t, p, e), Path("/nonexistent")).is_file()]
    if missing:
        raise NanoEvalError(f"{iter_dir}: missing shards {missing} of tp={tp} x pp={pp}" + (f" x ep={ep}" if ep > 1
                            else "") + ". Fix: finish copying the checkpoint.")
    checked = {key: folder.file(path) for key, path in found.items()}
    return checked if allow_expert_shards else {key[:2]: path for key, path in checked.items()}


def read_megatron_checkpoint(iter_dir: str | Path, overrides: Mapping | None = None,
                             policy: FilePolicy = FilePolicy()) -> tuple[dict[str, torch.Tensor], dict, list[int]]:
    """Merged TP shards of every PP stage: ({name: full tensor} with global layer numbers, args, layers per stage).
    linear_fc1 is returned already un-fused as `...linear_fc1.gate.weight` / `...linear_fc1.up.weight`.
    overrides: Megatron argument names/values that replace the pickled `args`.
    A torch_dist checkpoint is first loaded by megatron-core into one TP1 GPTModel (megatron_dist.py)."""
    folder = Folder(iter_dir, policy).check()
    iter_dir = folder.root
    if is_dist_checkpoint(iter_dir) and not any(SHARD_DIR.match(p.name) for p in iter_dir.iterdir()):
        state, args = read_dist_checkpoint(iter_dir, args_dict(overrides), policy)
        stage = _merge_tp([state], iter_dir)
        return stage, args, [1 + max((int(m.group(1)) for k in stage if (m := LAYER.match(k))), default=-1)]
    files = shard_files(folder)
    tp, pp = max(t for t, _ in files) + 1, max(p for _, p in files) + 1
    merged: dict[str, torch.Tensor] = {}
    args: dict = {}
    layers_per_stage = []
    offset = 0
    for p in range(pp):
        shards = [load_shard(files[(t, p)]) for t in range(tp)]
        args = args or args_dict(shards[0].get("args"))
        for t, shard in enumerate(shards):
            if not isinstance(shard.get("model"), dict):
                keys = sorted(str(k) for k in shard if str(k).startswith("model"))
                raise CheckpointFileError(files[(t, p)], f"has no 'model' state dict (found {keys}); "
                                          "virtual-pipeline checkpoints (model0, model1, ...) are not supported")
        stage = _merge_tp([s["model"] for s in shards], files[(0, p)])
        numbers = [int(m.group(1)) for k in stage if (m := LAYER.match(k))]
        n_layers = 1 + max(numbers, default=-1)
        for name, tensor in stage.items():
            merged[LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)] = tensor
        layers_per_stage.append(n_layers)
        offset += n_layers
    return merged, {**args, **args_dict(overrides)}, layers_per_stage


def _merge_tp(shards: list[dict], where: Path) -> dict[str, torch.Tensor]:
    """Full tensors of one PP stage from its TP shards (state dicts with Megatron names)."""
    out = {}
    for name, first in shards[0].items():
        if not isinstance(name, str) or name.endswith("_extra_state") or not isinstance(first, torch.Tensor):
            continue
        parts = [s.get(name) for s in shards]
        if not all(isinstance(t, torch.Tensor) and t.dim() == first.dim() and t.dtype == first.dtype for t in parts):
            raise CheckpointFileError(where, f"{name} is missing, or differs in rank or dtype, on some TP shards")
        if name.endswith("linear_fc1.weight"):  # each shard is [gate_r | up_r]
            halves = [t.chunk(2, dim=0) for t in parts]
            out[name.replace("linear_fc1.weight", "linear_fc1.gate.weight")] = torch.cat([h[0] for h in halves])
            out[name.replace("linear_fc1.weight", "linear_fc1.up.weight")] = torch.cat([h[1] for h in halves])
        elif name.endswith(COLUMN_PARALLEL):
            out[name] = torch.cat(parts, dim=0)
        elif name.endswith(ROW_PARALLEL):
            out[name] = torch.cat(parts, dim=1)
        elif first.dim() <= 1 and not name.endswith("bias"):
            out[name] = first  # norms: replicated on every TP rank
        else:
            raise NanoEvalError(f"{where}: unexpected parameter {name} {tuple(first.shape)}; only Llama-style GPT "
                                "checkpoints (no biases) can be converted.")
    return out


def _norm(weights: dict, layer: str, fused: str, local: str) -> torch.Tensor:
    """A pre-norm weight under the TE name (fused into the next linear) or the local-spec name."""
    return weights[f"{layer}{fused}"] if f"{layer}{fused}" in weights else weights[f"{layer}{local}"]


def hf_state_dict(weights: dict[str, torch.Tensor], config, interleaved_rotary: bool = False) -> dict:
    """Merged Megatron names and layouts -> transformers' LlamaForCausalLM."""
    nq, ng, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    out = {"model.embed_tokens.weight": weights["embedding.word_embeddings.weight"],
           "model.norm.weight": weights["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in weights and not config.tie_word_embeddings:
        out["lm_head.weight"] = weights["output_layer.weight"]
    for i in range(config.num_hidden_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        grouped = weights[src + "self_attention.linear_qkv.weight"].view(ng, (nq // ng + 2) * d, -1)
        q, k, v = (t.reshape(-1, t.shape[-1]) for t in grouped.split([nq // ng * d, d, d], dim=1))
        if interleaved_rotary:
            q, k = interleaved_to_half_rotary(q, nq), interleaved_to_half_rotary(k, ng)
        out |= {
            dst + "self_attn.q_proj.weight": q, dst + "self_attn.k_proj.weight": k, dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": weights[src + "self_attention.linear_proj.weight"],
            dst + "mlp.gate_proj.weight": weights[src + "mlp.linear_fc1.gate.weight"],
            dst + "mlp.up_proj.weight": weights[src + "mlp.linear_fc1.up.weight"],
            dst + "mlp.down_proj.weight": weights[src + "mlp.linear_fc2.weight"],
            dst + "input_layernorm.weight": _norm(weights, src, "self_attention.linear_qkv.layer_norm_weight",
                                                  "input_layernorm.weight"),
            dst + "post_attention_layernorm.weight": _norm(weights, src, "mlp.linear_fc1.layer_norm_weight",
                                                           "pre_mlp_layernorm.weight"),
        }
    return {k: v.contiguous() for k, v in out.items()}


def load_megatron_llama_as_hf(iter_dir: str | Path, megatron_args: Mapping | Namespace | None = None,
                              policy: FilePolicy = FilePolicy()):
    """A transformers LlamaForCausalLM (fp32) holding a legacy Megatron checkpoint's weights.
    megatron_args: Megatron argument names/values that override (or replace) the pickled `args`."""

    weights, args, layers = read_megatron_checkpoint(iter_dir, megatron_args, policy)
    if "embedding.word_embeddings.weight" not in weights:
        raise NanoEvalError(f"{iter_dir}: no embedding.word_embeddings.weight; is it a GPT checkpoint?")
    config = hf_config_from_args(args, vocab_size=weights["embedding.word_embeddings.weight"].shape[0])
    if sum(layers) != config.num_hidden_layers:
        raise NanoEvalError(f"{iter_dir}: the shards hold {sum(layers)} layers ({layers} per stage) but args say "
                            f"num_layers={config.num_hidden_layers}.")
    try:
        state = hf_state_dict(weights, config, interleaved_rotary=bool(args.get("rotary_interleaved")))
    except KeyError as e:
        raise NanoEvalError(f"{iter_dir}: the checkpoint lacks {e}; is it a Llama-style GPTModel?") from e
    return llama_from_state_dict(config, state, str(iter_dir), policy)


# ---- loading as a backend ------------------------------------------------------------------------------------

def is_megatron_checkpoint(path: str) -> bool:
    """An `iter_*` / `release` folder (mp_rank_* shards or torch_dist files), or a run dir with a tracker file."""
    p = Path(path)
    if not p.is_dir():
        return False
    if (p / TRACKER).is_file():
        return True
    return bool(ITER_DIR.match(p.name)) and (any(p.glob("mp_rank_*")) or (p / ".metadata").exists())


def resolve_iteration_dir(path: str, policy: FilePolicy = FilePolicy()) -> Path:
    """The iteration folder: `path` itself, or the one the run dir's tracker names (an int, or "release"), which
    must lie inside the run dir."""
    p = Path(path)
    if not os.path.lexists(p / TRACKER):
        return p
    run = Folder(p, policy, what="run")
    text = run.read_bytes(TRACKER, 64).decode("ascii", "replace").strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() and len(text) < 10 else None
    if name is None or not (p / name).is_dir():
        raise NanoEvalError(f"{p / TRACKER} says {text!r:.40} but {p / (name or '?')} does not exist. "
                            "Fix: pass an iter_XXXXXXX folder directly.")
    target = Path(os.path.realpath(p / name))
    if not run.inside(target) and not policy.allow_symlinks_outside:
        raise CheckpointFileError(p / name, f"resolves to {target}, outside the run folder {run.root}",
                                  "pass the iteration folder itself, or --allow-symlinks-outside if you trust it")
    return p / name


def load_as_transformers(checkpoint: str, tokenizer_path: str | None, *, device: str = "cpu", dtype: str = "float32",
                         max_length: int | None = None, megatron_args: dict | None = None,
                         policy: FilePolicy = FilePolicy()):
    """A TransformersModel backend holding the Megatron checkpoint's weights."""
    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.checkpoints.files import load_tokenizer

    if not tokenizer_path:
        raise NanoEvalError(f"checkpoint {checkpoint}: Megatron checkpoints do not hold a tokenizer. "
                            "Fix: pass --tokenizer PATH_OR_HUB_ID (the one the run trained with).")
    tokenizer = load_tokenizer(tokenizer_path, checkpoint, policy=policy)  # before the weights: fails in a second
    model = load_megatron_llama_as_hf(resolve_iteration_dir(checkpoint, policy), megatron_args, policy)
    model = model.to(device=device, dtype=getattr(torch, dtype))
    return TransformersModel(model, tokenizer, max_length=max_length)
