"""Score nanotron checkpoints from the command line, on any machine.

A nanotron checkpoint folder holds `config.yaml` and `model/` (sharded safetensors with their TP/PP layout in the
file names). nanotron's own model classes need flash-attn on CUDA, so the command line reads Llama checkpoints
into transformers' LlamaForCausalLM (nano_eval/models/nanotron_to_hf.py): same scores, any machine, any saved
layout. Inside a training job, score the live model with NanotronModel instead.
"""

from __future__ import annotations

from pathlib import Path

from nano_eval.errors import NanoEvalError


def is_nanotron_checkpoint(path: str) -> bool:
    p = Path(path)
    return (p / "config.yaml").is_file() and (p / "model").is_dir()


def tokenizer_path(checkpoint: str, override: str | None) -> str:
    """--tokenizer, else config.yaml's tokenizer.tokenizer_name_or_path."""
    if override:
        return override
    import yaml

    config = yaml.safe_load((Path(checkpoint) / "config.yaml").read_text()) or {}
    name = (config.get("tokenizer") or {}).get("tokenizer_name_or_path")
    if not name:
        raise NanoEvalError(
            f"checkpoint {checkpoint}: config.yaml names no tokenizer (tokenizer.tokenizer_name_or_path). "
            "Fix: pass --tokenizer PATH_OR_HUB_ID."
        )
    return name


def load_as_transformers(checkpoint: str, tokenizer: str | None, *, device: str, dtype: str, max_length: int | None):
    """A TransformersModel backend holding the nanotron checkpoint's weights."""
    import torch
    from transformers import AutoTokenizer

    from nano_eval.models.nanotron_to_hf import load_nanotron_llama_as_hf
    from nano_eval.models.transformers_model import TransformersModel

    tok = AutoTokenizer.from_pretrained(tokenizer_path(checkpoint, tokenizer))
    model = load_nanotron_llama_as_hf(checkpoint).to(device=device, dtype=getattr(torch, dtype))
    return TransformersModel(model, tok, max_length=max_length)


def missing_requirements() -> list[str]:
    """What this machine lacks to build nanotron's own model classes (empty when it can)."""
    import importlib.util

    import torch

    missing = []
    if importlib.util.find_spec("nanotron") is None:
        missing.append("nanotron (pip install 'nano_eval[nanotron]')")
    if importlib.util.find_spec("flash_attn") is None:
        missing.append("flash-attn (pip install flash-attn)")
    if not torch.cuda.is_available():
        missing.append("a CUDA device")
    return missing


def load_native(checkpoint: str, tokenizer: str | None, *, tp: int, pp: int, dtype: str, max_length: int | None):
    """nanotron's own model class in a tp x pp x dp layout (dp = world / (tp x pp)), weights resharded on load by
    nanotron's load_weights. Needs torchrun, CUDA and flash-attn. GPU-only: tested in tests/test_gpu.py."""
    import os

    missing = missing_requirements()
    if missing:
        raise NanoEvalError(
            f"--backend nanotron builds nanotron's own model class, which needs flash-attn on CUDA; this machine "
            f"lacks: {', '.join(missing)}. Fix: run on a GPU node with those installed, or use --backend transformers "
            "(reads the same checkpoint into a transformers Llama; same scores)."
        )
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world == 0 or world % (tp * pp):
        raise NanoEvalError(
            f"--backend nanotron needs torchrun with a world size divisible by tp x pp = {tp * pp} "
            f"(WORLD_SIZE={world or 'unset'}). Fix: torchrun --nproc_per_node={tp * pp} nano_eval/run.py ..."
        )
    import torch
    from transformers import AutoTokenizer

    from nano_eval.compat.nanotron import import_nanotron
    from nano_eval.models.nanotron_model import NanotronModel

    import_nanotron()
    from nanotron.config import ParallelismArgs, get_config_from_file
    from nanotron.models import build_model
    from nanotron.parallel import ParallelContext
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
    from nanotron.serialize import load_weights
    from nanotron.trainer import CONFIG_TO_MODEL_CLASS, mark_tied_parameters

    model_config = get_config_from_file(str(Path(checkpoint) / "config.yaml")).model.model_config
    parallel = ParallelismArgs(dp=world // (tp * pp), pp=pp, tp=tp, tp_mode=TensorParallelLinearMode.ALL_REDUCE,
                               tp_linear_async_communication=False)
    pc = ParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=world // (tp * pp))
    model_class = CONFIG_TO_MODEL_CLASS[type(model_config).__name__]
    model = build_model(
        model_builder=lambda: model_class(config=model_config, parallel_context=pc, parallel_config=parallel,
                                          random_states=None),
        parallel_context=pc, dtype=getattr(torch, dtype), device=torch.device("cuda"),
    )
    mark_tied_parameters(model=model, parallel_context=pc, parallel_config=parallel)
    load_weights(model=model, parallel_context=pc, root_folder=Path(checkpoint))
    tok = AutoTokenizer.from_pretrained(tokenizer_path(checkpoint, tokenizer))
    return NanotronModel(model, pc, tok, max_length=max_length or model_config.max_position_embeddings, device="cuda")
