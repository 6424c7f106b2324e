"""nanotron checkpoints: read a Llama checkpoint (any saved TP/PP layout) into transformers, or into nanotron's own
model.

A nanotron checkpoint folder holds `config.yaml` and `model/` (sharded safetensors with their TP/PP layout in the
file names). nanotron's own model classes need flash-attn, so by default the command line reads Llama checkpoints
into transformers' LlamaForCausalLM (`load_as_transformers`): same scores, any machine, any saved layout, and
neither nanotron nor a process group is needed (shards are merged from the slice metadata nanotron writes into
every safetensors file). `load_native` builds nanotron's own model in a TP x PP layout instead (--backend nanotron). Inside a
training job, score the live model with nano_eval.backends.nanotron.NanotronModel.

Two things differ from transformers' Llama:
- fused projections: `qkv_proj` rows are [q | k | v] and `gate_up_proj` rows are [gate | up] (each split across TP
  ranks chunk by chunk; merging by the saved global slices restores the full fused matrix);
- rotary layout: nanotron 0.4 trains with interleaved rotary pairs (x[2i], x[2i+1]) (flash-attn `interleaved=True`),
  transformers rotates halves (x[i], x[i + d/2]); permuting each head's q/k rows turns one into the other.
  nanotron main records the layout as `rope_interleaved` in the model config; when it says false, no permutation.
nanotron main's Qwen2 is such a Llama when it is dense, without qkv bias, sliding window or no-RoPE layers; with
those it becomes transformers' SmolLM3 (nano_eval.checkpoints.nanotron_qwen2); MoE and the other fields of
UNCONVERTIBLE_FIELDS are refused by name, pointing to `--backend nanotron`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from nano_eval.checkpoints.cover import cover_problem
from nano_eval.checkpoints.llama import check_config_size, interleaved_to_half_rotary, llama_from_state_dict
from nano_eval.checkpoints.nanotron_qwen2 import add_attention_biases, needs_smollm3, smollm3_config_from
from nano_eval.compat.nanotron import NUMPY_SCALAR_REPR  # no nanotron import: plain regex
from nano_eval.checkpoints.files import check_safetensors, load_tokenizer, safetensors_header
from nano_eval.checkpoints.untrusted import CheckpointFileError, FilePolicy, Folder
from nano_eval.errors import NanoEvalError

_SHARD_SUFFIX = re.compile(r"_pp-rank-\d+-of-\d+_tp-rank-\d+-of-\d+$")


def _slices(text: str) -> tuple[slice, ...]:
    """'0,10,None|None,None,None' -> (slice(0, 10), slice(None))."""
    return tuple(slice(*(None if x == "None" else int(x) for x in part.split(","))) for part in text.split("|"))


def _shape(text: str) -> tuple[int, ...]:
    """nanotron's `unsharded_shape` metadata ("(544, 64)", or numpy scalars' reprs) as integers."""
    return tuple(int(x) for x in NUMPY_SCALAR_REPR.sub(r"\1", text).strip("()").split(",") if x.strip())


def weight_files(folder: Folder) -> dict[str, list[Path]]:
    """{parameter name: its shard files} of a checked nanotron checkpoint folder."""
    root = folder.root / "model"
    files = sorted(root.rglob("*.safetensors"))
    if not files:
        raise NanoEvalError(f"checkpoint {folder.given} has no model/*.safetensors. Fix: pass a nanotron checkpoint "
                            "folder.")
    check_safetensors(files, folder.given)
    by_name: dict[str, list[Path]] = {}
    for file in files:
        leaf = _SHARD_SUFFIX.sub("", file.stem).removeprefix("model_")
        by_name.setdefault(".".join((*file.parent.relative_to(root).parts, leaf)), []).append(folder.file(file))
    return by_name


def check_weight_sizes(by_name: dict[str, list[Path]], policy: FilePolicy, where: str | Path) -> int:
    """Refuse an `unsharded_shape` larger than the elements its shards hold (before the full tensor is allocated);
    returns the bytes of the merged weights."""
    total = 0
    for name, files in by_name.items():
        headers = [safetensors_header(f) for f in files]
        shards = [h.tensors.get("data") for h in headers]
        if any(s is None for s in shards):
            raise CheckpointFileError(files[0], "holds no tensor named 'data' (nanotron saves each weight as one)")
        held = sum(s.numel for s in shards)
        shapes = {h.metadata.get("unsharded_shape") for h in headers}
        declared = held if shapes == {None} else max(_numel(_shape(str(x))) for x in shapes if x is not None)
        if declared > held:
            raise CheckpointFileError(files[0], f"{name} declares an unsharded shape of {declared:,} elements but its "
                                      f"{len(files)} shard(s) hold {held:,}")
        total += declared * shards[0].itemsize
    policy.check_allocation(total, where, "the merged weights")
    return total


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def read_nanotron_weights(checkpoint: str | Path, policy: FilePolicy = FilePolicy()) -> dict[str, torch.Tensor]:
    """Full tensors keyed by parameter name (e.g. `model.decoder.0.pp_block.attn.qkv_proj.weight`)."""
    by_name = weight_files(Folder(checkpoint, policy).check())
    check_weight_sizes(by_name, policy, checkpoint)
    return {name: merge_shards(name, files) for name, files in by_name.items()}


def shard_layout(name: str, files: list[Path]) -> tuple[tuple[int, ...], list[list]] | None:
    """(unsharded shape, each file's (local, global) slice pairs) of one parameter, read from the files' metadata
    only; None for a parameter saved whole in its one file (no slice metadata).

    Refused unless the global slices cover the unsharded shape exactly once (nano_eval.checkpoints.cover): the
    merged tensor starts as uninitialised memory (and nanotron's own loader starts from the new model's values), so
    a gap would stay in the weights (two loads of one checkpoint gave acc 0.00 and 0.25). Each file's pairs are
    counted before they are parsed, against the elements the tensor holds (no more non-empty disjoint slices can
    exist), so a header listing millions of pairs is refused at once instead of being parsed and copied one by one."""
    metas = [safetensors_header(f).metadata for f in files]
    if len(files) == 1 and "unsharded_shape" not in metas[0]:
        return None
    shape = None
    for file, meta in zip(files, metas):
        if "unsharded_shape" not in meta:
            raise CheckpointFileError(file, f"{name} is split over {len(files)} files but this one has no slice "
                                      "metadata (unsharded_shape), so its place in the full tensor is unknown")
        if shape is not None and _shape(meta["unsharded_shape"]) != shape:
            raise CheckpointFileError(file, f"{name}: unsharded_shape {_shape(meta['unsharded_shape'])} differs "
                                      f"from the {shape} its other shards declare")
        shape = _shape(meta["unsharded_shape"])
    budget, pairs, boxes = _numel(shape), [], []
    for file, meta in zip(files, metas):
        text = meta.get("local_global_slices_pairs", "")
        count = text.count(";") + 1
        if not text or count > budget:
            raise CheckpointFileError(file, f"{name}: {count:,} slice pairs where its tensor of {_numel(shape):,} "
                                      "elements leaves room for at most "
                                      f"{budget:,} more (each pair must write at least one element, none twice)")
        budget -= count
        pairs.append([_pair(p, file, name) for p in text.split(";")])
        for _, global_ in pairs[-1]:
            if len(global_) != len(shape):
                raise CheckpointFileError(file, f"{name}: a global slice {global_} has {len(global_)} dimensions, "
                                          f"its unsharded shape {shape} {len(shape)}")
            ranges = [s.indices(n) for s, n in zip(global_, shape)]
            boxes.append((tuple(a for a, _, _ in ranges), tuple(max(0, b - a) for a, b, _ in ranges)))
    problem = cover_problem(shape, boxes)
    if problem is not None:
        raise CheckpointFileError(files[0].parent, f"{name}: its {len(files)} shard file(s) do not cover its "
                                  f"unsharded shape {shape} exactly once ({problem}); the rest would be "
                                  "uninitialised memory (a shard file missing, or its slice metadata damaged)")
    return shape, pairs


def merge_shards(name: str, files: list[Path]) -> torch.Tensor:
    """One parameter's full tensor from its shard files: a file without slice metadata is the whole tensor (when it
    is the parameter's one file); otherwise every shard's `local_global_slices_pairs` copy its slices into a tensor
    of `unsharded_shape` (nanotron.parallel.sharded_parameters writes them, one pair per contiguous chunk), once
    shard_layout has checked that they cover it exactly once."""
    from safetensors import safe_open

    layout = shard_layout(name, files)
    if layout is None:
        with safe_open(str(files[0]), framework="pt") as f:
            return f.get_tensor("data")
    shape, pairs = layout
    full = None
    for file, file_pairs in zip(files, pairs):
        with safe_open(str(file), framework="pt") as f:
            data = f.get_tensor("data")
        if full is None:
            full = torch.empty(shape, dtype=data.dtype)
        for local, global_ in file_pairs:
            try:
                source = data[local]
            except (IndexError, ValueError, TypeError) as e:
                raise CheckpointFileError(file, f"{name}: local slice {local} does not index the shard "
                                          f"{tuple(data.shape)} ({e})") from e
            if full[global_].shape != source.shape:
                raise CheckpointFileError(file, f"{name}: slice {global_} of the full tensor {shape} does not "
                                          f"match slice {local} of the shard {tuple(data.shape)}")
            full[global_] = source
    return full


def _pair(text: str, file: Path, name: str) -> tuple[tuple[slice, ...], tuple[slice, ...]]:
    """(local slices, global slices) of one 'local#global' pair, steps of 1 only (nanotron writes no others)."""
    try:
        local, global_ = (_slices(x) for x in text.split("#"))
    except (ValueError, TypeError) as e:
        raise CheckpointFileError(file, f"{name}: slice pair {text!r:.100} is not 'start,stop,step|...#...' "
                                  f"({e})") from e
    if any(s.step not in (None, 1) for s in local + global_):
        raise CheckpointFileError(file, f"{name}: slice pair {text!r:.100} has a step other than 1")
    return local, global_


# model_config fields that change what nanotron main's Qwen2 computes and that no transformers conversion here
# expresses, with the value that means "off" (no-RoPE layers, qkv bias and sliding window convert to transformers'
# SmolLM3: nano_eval.checkpoints.nanotron_qwen2). Fields
# nanotron's models never read (rope_scaling, pretraining_tp, use_cache) or that only shape training (z_loss_*,
# _use_doc_masking, log_attn_probs) are not listed: the conversion computes what the trained model computes.
UNCONVERTIBLE_FIELDS = {
    "moe_config": (None, "mixture-of-experts layers"),
    "rope_seq_len_interpolation_factor": (None, "interpolated RoPE positions"),
    "flex_attention_mask": (None, "a flex-attention mask"),
}


def model_class_name(model_config: dict) -> str:
    """The nanotron config class a config.yaml's model_config was saved from (its `is_*_config` flag)."""
    flags = {"is_qwen2_config": "Qwen2Config (nanotron main's Qwen2ForTraining)",
             "is_llama_config": "LlamaConfig (nanotron's LlamaForTraining)"}
    return next((name for flag, name in flags.items() if model_config.get(flag)), "an unknown model config")


def refuse_unconvertible(model_config: dict, checkpoint) -> None:
    """Refuse, naming the field, a model the transformers Llama conversion would read with silently wrong scores
    (each field of UNCONVERTIBLE_FIELDS set to anything but its "off" value). nanotron's LlamaForTraining (0.4 and
    main) reads none of them (main's LlamaConfig has an `attention_bias` its model ignores): Llama configs pass."""
    if model_config.get("is_llama_config"):
        return
    found = [f"{k}: {model_config[k]!r} ({what})" for k, (off, what) in UNCONVERTIBLE_FIELDS.items()
             if model_config.get(k) not in (None, off)]
    if found:
        raise NanoEvalError(
            f"checkpoint {checkpoint}: config.yaml's model is {model_class_name(model_config)} with "
            f"{'; '.join(found)}, which no transformers conversion reproduces (its scores would be "
            f"wrong). Fix: score it with nanotron's own model: torchrun --nproc_per_node=N nano_eval/run.py "
            f"--backend nanotron --checkpoint {checkpoint} ... (needs nanotron main installed)")


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


def hf_state_dict(weights: dict[str, torch.Tensor], config, rope_interleaved: bool = True) -> dict[str, torch.Tensor]:
    """Map nanotron Llama names and layouts to transformers' LlamaForCausalLM. `rope_interleaved`: the model
    config's flag where the nanotron version has one (main); nanotron 0.4 has none and is always interleaved."""
    rotary = interleaved_to_half_rotary if rope_interleaved else (lambda w, heads: w)
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
            dst + "self_attn.q_proj.weight": rotary(q, config.num_attention_heads),
            dst + "self_attn.k_proj.weight": rotary(k, config.num_key_value_heads),
            dst + "self_attn.v_proj.weight": v,
            dst + "self_attn.o_proj.weight": weights[src + "attn.o_proj.weight"],
            dst + "mlp.gate_proj.weight": gate,
            dst + "mlp.up_proj.weight": up,
            dst + "mlp.down_proj.weight": weights[src + "mlp.down_proj.weight"],
            dst + "input_layernorm.weight": weights[src + "input_layernorm.weight"],
            dst + "post_attention_layernorm.weight": weights[src + "post_attention_layernorm.weight"],
        }
    return {k: v.contiguous() for k, v in out.items()}


def load_nanotron_llama_as_hf(checkpoint: str | Path, model_config: dict | None = None,
                              policy: FilePolicy = FilePolicy()):
    """A transformers LlamaForCausalLM holding the checkpoint's weights (SmolLM3ForCausalLM for a nanotron main Qwen2
    with no-RoPE layers, qkv bias or a sliding window: nano_eval.checkpoints.nanotron_qwen2). `model_config`
    defaults to the `model.model_config` section of the checkpoint's config.yaml."""
    if model_config is None:
        model_config = read_model_config(checkpoint, policy)
    refuse_unconvertible(model_config, checkpoint)
    try:
        config = hf_config_from(model_config)
    except (KeyError, TypeError, ValueError) as e:
        raise NanoEvalError(f"checkpoint {checkpoint}: config.yaml's model.model_config is not a Llama's ({e}). Fix: "
                            "restore config.yaml from the training run.") from e
    weights = read_nanotron_weights(checkpoint, policy)
    interleaved = bool(model_config.get("rope_interleaved", True))
    model_class = None
    try:
        state = hf_state_dict(weights, config, interleaved)
        if needs_smollm3(model_config):  # no-RoPE layers, qkv bias, sliding window: see nanotron_qwen2
            from transformers import SmolLM3ForCausalLM

            config, model_class = smollm3_config_from(model_config, config), SmolLM3ForCausalLM
            state = add_attention_biases(state, weights, config,
                                         interleaved_to_half_rotary if interleaved else (lambda w, heads: w))
    except (KeyError, RuntimeError) as e:
        raise NanoEvalError(f"checkpoint {checkpoint}: its weights do not fit config.yaml's "
                            f"{model_class_name(model_config)} ({e}). Fix: restore the checkpoint from the training "
                            "run.") from e
    return llama_from_state_dict(config, state, f"checkpoint {checkpoint}", policy, model_class=model_class)


def read_config_yaml(checkpoint: str | Path, policy: FilePolicy = FilePolicy()) -> dict:
    """config.yaml as a dict (untrusted.parse_yaml: no alias bombs, sizes bounded); a NanoEvalError naming the file
    and line when it is not valid YAML."""
    config = Folder(checkpoint, policy).read_yaml("config.yaml")
    return config if isinstance(config, dict) else {}


def read_model_config(checkpoint: str | Path, policy: FilePolicy = FilePolicy()) -> dict:
    path = Path(checkpoint) / "config.yaml"
    try:
        config = read_config_yaml(checkpoint, policy)["model"]["model_config"]
    except (KeyError, TypeError) as e:
        raise NanoEvalError(f"checkpoint {checkpoint}: cannot read model.model_config from {path} ({e}).") from e
    if not isinstance(config, dict):
        raise NanoEvalError(f"checkpoint {checkpoint}: model.model_config in {path} is not a mapping.")
    return config


# ---- loading as a backend ------------------------------------------------------------------------------------

def is_nanotron_checkpoint(path: str) -> bool:
    p = Path(path)
    return (p / "config.yaml").is_file() and (p / "model").is_dir()


def tokenizer_path(checkpoint: str, override: str | None, policy: FilePolicy = FilePolicy()) -> str:
    """--tokenizer, else config.yaml's tokenizer.tokenizer_name_or_path."""
    if override:
        return override
    config = read_config_yaml(checkpoint, policy)
    section = config.get("tokenizer")
    name = section.get("tokenizer_name_or_path") if isinstance(section, dict) else None
    if not isinstance(name, str) or not name:
        raise NanoEvalError(
            f"checkpoint {checkpoint}: config.yaml names no tokenizer (tokenizer.tokenizer_name_or_path). "
            "Fix: pass --tokenizer PATH_OR_HUB_ID."
        )
    return name


def load_as_transformers(checkpoint: str, tokenizer: str | None, *, device: str, dtype: str, max_length: int | None,
                         policy: FilePolicy = FilePolicy()):
    """A TransformersModel backend holding the nanotron checkpoint's weights."""
    from nano_eval.backends.transformers import TransformersModel

    tok = load_tokenizer(tokenizer_path(checkpoint, tokenizer, policy), checkpoint, policy=policy)
    model = load_nanotron_llama_as_hf(checkpoint, policy=policy).to(device=device, dtype=getattr(torch, dtype))
    return TransformersModel(model, tok, max_length=max_length)


def missing_requirements() -> list[str]:
    """What this machine lacks to build nanotron's own model classes (empty when it can)."""
    import importlib.util

    missing = []
    if importlib.util.find_spec("nanotron") is None:
        missing.append("nanotron (pip install -e '.[nanotron]' in the nano_eval checkout)")
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn_2_cuda") is None:
        missing.append("flash-attn with its CUDA kernels (pip install flash-attn on a CUDA machine; nanotron's Llama "
                       "imports them)")
    return missing


def load_native(checkpoint: str, tokenizer: str | None, *, tp: int, pp: int, dtype: str, max_length: int | None,
                tp_mode: str = "ALL_REDUCE", policy: FilePolicy = FilePolicy()):
    """nanotron's own model class in a tp x pp x dp layout (dp = world / (tp x pp)), weights resharded on load by
    nanotron's load_weights. Needs torchrun and flash-attn; runs on CUDA when there is one. (The test suite runs it
    on CPU with a flash-attn test double and CPU patches that live in tests/.)"""
    import os

    from nano_eval.compat.nanotron import has_qwen2

    if read_model_config(checkpoint, policy).get("is_qwen2_config") and not has_qwen2():
        raise NanoEvalError(
            f"checkpoint {checkpoint} holds nanotron main's Qwen2 (config.yaml: is_qwen2_config), which the installed "
            "nanotron (0.4) does not have. Fix: pip install --no-deps \"nanotron @ git+https://github.com/"
            "huggingface/nanotron@2411b022a75fb7f7561a1bb4166706da5e1b76de\", or score it with --backend "
            "transformers (dense, no-RoPE, qkv-bias and sliding-window Qwen2 convert exactly)")
    missing = missing_requirements()
    if missing:
        raise NanoEvalError(
            f"--backend nanotron builds nanotron's own model class; this machine lacks: {', '.join(missing)}. "
            "Fix: install them (flash-attn needs a CUDA machine), or use --backend transformers "
            "(reads the same checkpoint into a transformers Llama; same scores)."
        )
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world == 0 or world % (tp * pp):
        raise NanoEvalError(
            f"--backend nanotron needs torchrun with a world size divisible by tp x pp = {tp * pp} "
            f"(WORLD_SIZE={world or 'unset'}). Fix: torchrun --nproc_per_node={tp * pp} nano_eval/run.py ..."
        )

    # nanotron's own loader trusts the files: check them first (folder, YAML, shard sizes vs the config's model)
    folder = Folder(checkpoint, policy).check()
    model_dict = read_model_config(checkpoint, policy)
    by_name = weight_files(folder)
    check_weight_sizes(by_name, policy, checkpoint)
    for name, files in by_name.items():  # nanotron's load_weights would leave a gap as the new model's values
        shard_layout(name, files)
    try:
        check_config_size(hf_config_from(model_dict), sum(f.stat().st_size for fs in by_name.values() for f in fs),
                          f"checkpoint {checkpoint}", policy)
    except (KeyError, TypeError, ValueError) as e:
        raise NanoEvalError(f"checkpoint {checkpoint}: config.yaml's model.model_config is not a Llama's ({e}).") from e

    from nano_eval.backends.nanotron import NanotronModel
    from nano_eval.compat.nanotron import cpu_parallel_context, import_nanotron
    from nano_eval.training.nanotron import load_config

    import_nanotron()
    from nanotron.config import ParallelismArgs
    from nanotron.models import build_model
    from nanotron.parallel import ParallelContext
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
    from nanotron.serialize import load_weights
    from nanotron.trainer import CONFIG_TO_MODEL_CLASS, mark_tied_parameters

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # nanotron's parser, widened to accept the `nano_eval:` section a training run with evaluation saves
    model_config = load_config(str(Path(checkpoint) / "config.yaml")).model.model_config
    dp = world // (tp * pp)
    parallel = ParallelismArgs(dp=dp, pp=pp, tp=tp, tp_mode=TensorParallelLinearMode[tp_mode],
                               tp_linear_async_communication=False)
    if device.type == "cuda":
        pc = ParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
    else:
        pc = cpu_parallel_context(tp=tp, pp=pp, dp=dp)
    model_class = CONFIG_TO_MODEL_CLASS[type(model_config).__name__]
    model = build_model(
        model_builder=lambda: model_class(config=model_config, parallel_context=pc, parallel_config=parallel,
                                          random_states=None),
        parallel_context=pc, dtype=getattr(torch, dtype), device=device,
    )
    mark_tied_parameters(model=model, parallel_context=pc, parallel_config=parallel)
    load_weights(model=model, parallel_context=pc, root_folder=Path(checkpoint))
    tok = load_tokenizer(tokenizer_path(checkpoint, tokenizer, policy), checkpoint, policy=policy)
    return NanotronModel(model, pc, tok, max_length=max_length or model_config.max_position_embeddings, device=device)
