"""Score a torchtitan DCP checkpoint (`<dump_folder>/checkpoint/step-N/`: `.metadata` + `__R_0.distcp`, saved in
any FSDP2 / TP / PP layout) with torchtitan's own model class, exactly as the live model is scored.

A torchtitan checkpoint holds tensors and training state but no model description: the model comes from torchtitan's
config registry, by the names the run was started with (`--module llama3 --config llama3_8b`): `--torchtitan-config
MODULE:CONFIG` on the command line, or `nano_eval_torchtitan.json`, which the training hook writes into each
checkpoint folder it sees saved (module, config, step, consumed tokens, sequence length). A name read from that file
is untrusted: only torchtitan's own model modules are imported from it; another module (your own config registry)
must be named on the command line. The tokenizer is not in the checkpoint either: `--tokenizer` (the run's
`hf_assets_path`).

Loading: the model is built on the meta device from the registry config (`update_from_config` as the Trainer
calls it, at TP / PP 1), materialised on CPU, and its own `state_dict()` (torchtitan's names, its hooks splitting
fused weights) is filled by torch.distributed.checkpoint's planner through nano_eval's checked reader (the rules of
Megatron's torch_dist: nano_eval.checkpoints.megatron_dist): `.metadata` unpickled by nano_eval's own unpickler and
checked whole, every weight a tensor entry (never pickled bytes) of the expected size whose chunks cover it exactly
once, each chunk read by nano_eval's torch.save reader; optimizer, data loader and train state entries are never
read. Then `load_state_dict` (strict). Each process holds the whole model (under torchrun: data parallel).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import torch

from nano_eval.checkpoints.files import load_tokenizer
from nano_eval.checkpoints.megatron_dist import INDEX, _check_cover, _reader_class, read_metadata_safely
from nano_eval.checkpoints.untrusted import CONFIG_BYTES, CheckpointFileError, FilePolicy, Folder
from nano_eval.errors import NanoEvalError

MODEL_FILE = "nano_eval_torchtitan.json"  # written by nano_eval.training.torchtitan
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_STEP = re.compile(r"step-(\d+)")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_torchtitan_checkpoint(path: str | Path) -> bool:
    """A torch.distributed.checkpoint folder that is not Megatron's (no `common.pt`), named `step-N` as
    torchtitan's checkpointer names them or holding the hook's model file."""
    p = Path(path)
    if not p.is_dir() or not (p / INDEX).is_file() or (p / "common.pt").exists():
        return False
    return bool(_STEP.fullmatch(p.name)) or (p / MODEL_FILE).is_file()


def model_names(folder: Folder, given: str | None) -> tuple[str, str, dict]:
    """(registry module, config function, the model file's other fields): `given` ("MODULE:CONFIG", the user's
    choice, any importable module) first, else the checkpoint's model file (torchtitan's own models only)."""
    saved = folder.read_json(MODEL_FILE, CONFIG_BYTES) if folder.has(MODEL_FILE) else {}
    if not isinstance(saved, dict):
        raise CheckpointFileError(folder.root / MODEL_FILE, "is not a JSON object")
    if given:
        module, sep, config = given.partition(":")
        if not sep or not _NAME.fullmatch(module) or not _NAME.fullmatch(config) or "." in config:
            raise NanoEvalError(f"--torchtitan-config {given!r}: expected MODULE:CONFIG, e.g. llama3:llama3_8b "
                                "(torchtitan's --module and --config). Fix: pass the names the run was started with")
        return module, config, saved
    module, config = saved.get("module"), saved.get("config")
    fix = ("pass --torchtitan-config MODULE:CONFIG, the --module and --config the run was started with (e.g. "
           "llama3:llama3_8b)")
    if not saved:
        raise CheckpointFileError(folder.given, "is a torchtitan checkpoint without a model description (torchtitan "
                                  f"saves none; nano_eval's training hook writes {MODEL_FILE})", fix)
    if not (isinstance(module, str) and isinstance(config, str) and _NAME.fullmatch(module)
            and _NAME.fullmatch(config) and "." not in config):
        raise CheckpointFileError(folder.root / MODEL_FILE, "does not name a module and a config function", fix)
    if module not in _torchtitan_models():
        raise CheckpointFileError(folder.root / MODEL_FILE, f"names the config registry {module!r}, which is not "
                                  "one of torchtitan's own models (nano_eval imports a module named in a checkpoint "
                                  "only from torchtitan)", f"{fix}, if you trust that module")
    return module, config, saved


def _torchtitan_models() -> set[str]:
    from torchtitan.models import _supported_models

    return set(_supported_models)


def trainer_config(module: str, config: str):
    """torchtitan's Trainer.Config from its config registry (`--module` / `--config`, as its ConfigManager finds
    them: torchtitan's models first, then an importable module of that name)."""
    candidates = ([f"torchtitan.models.{module}.config_registry"] if module in _torchtitan_models() else
                  [f"{module}.config_registry", module])
    registry = None
    for name in candidates:
        try:
            registry = importlib.import_module(name)
            break
        except ModuleNotFoundError:
            continue
    build = getattr(registry, config, None) if registry is not None else None
    if not callable(build):
        raise NanoEvalError(f"torchtitan config {module}:{config} not found (looked in {', '.join(candidates)}). "
                            "Fix: pass --torchtitan-config with the run's --module and --config")
    return build()


def build_model(trainer_cfg, seq_len: int | None):
    """torchtitan's model for `trainer_cfg` in one process (no parallelism), on CPU, initialised (to be loaded)."""
    from torchtitan.config import ParallelismConfig

    if seq_len is not None:
        trainer_cfg.training.seq_len = seq_len
    trainer_cfg.parallelism = ParallelismConfig(spmd_backend="partial_dtensor")
    model_config = trainer_cfg.model_spec.model
    model_config.update_from_config(config=trainer_cfg)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.eval()


def load_weights(model, folder: Folder, policy: FilePolicy) -> None:
    """Fill `model` from the DCP folder through the checked reader (module docstring); strict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    index = folder.root / INDEX
    metadata = read_metadata_safely(folder.root, policy)
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    wanted = 0
    for key, tensor in state.items():
        found = metadata.state_dict_metadata.get(key)
        if type(found) is not TensorStorageMetadata:
            what = "is missing" if found is None else "is stored as pickled bytes, not a tensor"
            raise CheckpointFileError(index, f"the model's {key} {what}", "check --torchtitan-config: the checkpoint "
                                      "must come from a run of that model")
        if tuple(found.size) != tuple(tensor.shape):
            raise CheckpointFileError(index, f"{key} is {list(found.size)}, the model's is {list(tensor.shape)}",
                                      "check --torchtitan-config: the checkpoint must come from a run of that model")
        _check_cover(key, found, index)
        wanted += tensor.numel() * tensor.element_size()
    if policy.max_bytes is not None and wanted > policy.max_bytes:
        raise CheckpointFileError(folder.given, f"holds a model of {wanted} bytes, more than --max-checkpoint-bytes")
    reader = _reader_class(folder, metadata, index)(str(folder.root))
    dcp.load(state, storage_reader=reader, no_dist=True)
    model.load_state_dict(state, strict=True)


def load_native(checkpoint: str, tokenizer: str | None, *, torchtitan_config: str | None, dtype: str,
                max_length: int | None, device: str = "cpu", policy: FilePolicy = FilePolicy()):
    """A TorchtitanModel backend (every process a data-parallel replica) holding the checkpoint's model."""
    from nano_eval.backends.torchtitan import TorchtitanModel

    folder = Folder(checkpoint, policy).check()
    module, config, saved = model_names(folder, torchtitan_config)
    if not tokenizer:
        used = saved.get("tokenizer") if isinstance(saved.get("tokenizer"), str) else None
        raise NanoEvalError(f"checkpoint {checkpoint}: torchtitan checkpoints do not hold a tokenizer. Fix: pass "
                            "--tokenizer PATH (the run's hf_assets_path" + (f", {used}" if used else "") + ")")
    tok = load_tokenizer(tokenizer, checkpoint, policy=policy)
    seq_len = saved.get("seq_len") if type(saved.get("seq_len")) is int and saved["seq_len"] > 0 else None
    cfg = trainer_config(module, config)
    model = build_model(cfg, seq_len)
    load_weights(model, folder, policy)
    _cast(model.to(device=device), _DTYPES[dtype])
    return TorchtitanModel([model], None, tok, max_length=max_length or cfg.training.seq_len, device=device)


def _cast(model, dtype: torch.dtype) -> None:
    """Real floating-point parameters and buffers to `dtype`; complex ones (torchtitan's RoPE cache) kept:
    `Module.to(dtype=float32)` would drop their imaginary part (logits 3e-3 off on the tests' model)."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_floating_point() and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)


def checkpoint_step(path: str | Path) -> int | None:
    """N of a `step-N` folder."""
    match = _STEP.fullmatch(Path(path).name)
    return int(match.group(1)) if match else None

