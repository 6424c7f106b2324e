"""transformers model folders and Hub ids: check that a folder holds a model, then load it as a backend.

A local folder is untrusted input (untrusted.py): it is walked once (no symlink out, no FIFO), its JSON files are
parsed with bounds, an index may only name shard files of the folder, safetensors headers are checked, and the
model its config.json declares must fit the bytes of its weight files and the allocation limit (counted on a
meta-device model) before transformers builds anything. `pytorch_model.bin` files are read by nano_eval's own
torch.save reader (torch_files.py) and handed to transformers as a state dict, so transformers never unpickles them.
A checkpoint's own Python code (trust_remote_code) stays off unless asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nano_eval.backends.transformers import TransformersModel
from nano_eval.checkpoints.files import check_safetensors, load_tokenizer, read_json_file
from nano_eval.checkpoints.llama import check_config_size
from nano_eval.checkpoints.pickles import TENSORS
from nano_eval.checkpoints.torch_files import load_torch
from nano_eval.checkpoints.untrusted import CheckpointFileError, FilePolicy, Folder
from nano_eval.errors import NanoEvalError
from nano_eval.parallel import ParallelLayout

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)
CONFIG_FILES = ("config.json", "generation_config.json")


def load_transformers(path: str, *, device: str = "cpu", dtype: str = "float32", max_length: int | None = None,
                      trust_remote_code: bool = False, layout: ParallelLayout | None = None,
                      tokenizer: str | None = None, policy: FilePolicy = FilePolicy()) -> TransformersModel:
    """A TransformersModel backend from a model folder (saved with save_pretrained) or a Hub id; `tokenizer`
    (a folder or Hub id) replaces the checkpoint's own."""
    from transformers import AutoModelForCausalLM

    folder = check_model_dir(path, policy)
    if folder is None or trust_remote_code:  # a Hub id, or code the user chose to trust: transformers loads it
        tok = load_tokenizer(tokenizer or path, path, trust_remote_code=trust_remote_code, policy=policy)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                     trust_remote_code=trust_remote_code)
        return TransformersModel(model.to(device), tok, layout=layout, max_length=max_length)
    config = _config(path)  # before the tokenizer, which reads config.json too: a bad value is named here
    tok = load_tokenizer(tokenizer or path, path, policy=policy)
    files = weight_files(folder)
    check_config_size(config, sum(f.stat().st_size for f in files), f"checkpoint {path}", policy)
    if files[0].name.endswith(".safetensors"):
        loaded = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=getattr(torch, dtype),
                                                      use_safetensors=True, output_loading_info=True)
    else:
        loaded = _from_bin(folder, config, files, dtype)
    model = _every_weight_loaded(*loaded, files[0])
    return TransformersModel(model.to(device), tok, layout=layout, max_length=max_length)


def _every_weight_loaded(model, info: dict, weights: Path):
    """`model`, when transformers filled every parameter from the weight files and found no weight the config has
    no place for; otherwise a CheckpointFileError. (transformers only warns: a missing weight is left randomly
    initialised, and a config declaring fewer layers than were saved drops the rest, both with plausible scores.)"""
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    mismatched = [str(k) for k in info.get("mismatched_keys") or ()]
    if missing or unexpected or mismatched:
        found = "; ".join(f"{what} {names[:4]}{' ...' if len(names) > 4 else ''}" for what, names in
                          (("missing", missing), ("unexpected", unexpected), ("other shapes", mismatched)) if names)
        raise CheckpointFileError(weights, f"does not hold the weights config.json describes ({found})",
                                  "restore the config.json and weight files of one save, or copy the checkpoint "
                                  "again")
    return model


def _config(path: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 -- ValueError, OSError, transformers' own validation errors
        raise CheckpointFileError(Path(path) / "config.json", f"does not describe a model transformers knows "
                                  f"({type(e).__name__}: {' '.join(str(e).split())[:200]})",
                                  "restore config.json from the run that saved the checkpoint") from e


def _from_bin(folder: Folder, config, files: list[Path], dtype: str):
    """(model, transformers' loading info) from pytorch_model.bin shard(s), read by nano_eval's reader (never
    transformers' torch.load)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    state: dict = {}
    for f in files:
        shard = load_torch(f, TENSORS)
        if not isinstance(shard, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in shard.items()):
            raise CheckpointFileError(f, "is not a state dict (names -> tensors)")
        state.update(shard)
    with torch.device("meta"):
        expected = {k: v.shape for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    wrong = [f"{k} {tuple(v.shape)} (config: {tuple(expected[k])})" for k, v in state.items()
             if k in expected and v.shape != expected[k]]
    if wrong:
        raise CheckpointFileError(files[0], f"holds weights of other shapes than config.json says: {wrong[:3]}",
                                  "restore the config.json that matches the weights, or copy the checkpoint again")
    model_class = AutoModelForCausalLM._model_mapping[type(config)]
    model, info = model_class.from_pretrained(None, config=config, state_dict=state, dtype=getattr(torch, dtype),
                                              output_loading_info=True)
    if folder.has("generation_config.json"):
        model.generation_config = GenerationConfig.from_pretrained(str(folder.root))
    return model, info


def weight_files(folder: Folder) -> list[Path]:
    """The weight files transformers will read: the single file, or every shard an index names (each a file of
    this folder)."""
    for index, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
        if folder.has(single):
            return [folder.file(single)]
        if folder.has(index):
            weight_map = read_json_file(folder, index, "weights index").get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointFileError(folder.root / index, "has no weight_map")
            names = sorted(set(weight_map.values()), key=str)
            for name in names:
                if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
                    raise CheckpointFileError(folder.root / index, f"names a shard {name!r:.100} that is not a file "
                                              "of the checkpoint folder")
            return [folder.file(name) for name in names]
    raise NanoEvalError(f"checkpoint {folder.given} has no weights (looked for {', '.join(WEIGHT_FILES)}). "
                        "Fix: point --checkpoint at a folder saved with save_pretrained, or finish copying the "
                        "checkpoint.")


def check_model_dir(path: str, policy: FilePolicy = FilePolicy()) -> Folder | None:
    """A local checkpoint folder must hold weights and parseable configs: say so clearly instead of failing deep
    inside transformers. Returns the checked folder (None for a Hub id)."""
    p = Path(path)
    if not os.path.lexists(p):
        if os.sep in path or path.startswith("."):
            raise NanoEvalError(f"checkpoint {path} does not exist. Fix: pass the folder that holds config.json.")
        return None  # a Hub id: transformers handles it
    if not p.is_dir():
        raise NanoEvalError(f"checkpoint {path} is a file. Fix: pass the folder that holds config.json and the weights.")
    folder = Folder(p, policy).check()
    if not folder.has("config.json"):
        raise NanoEvalError(f"checkpoint {path} has no config.json. Fix: pass a transformers model folder.")
    if not any(folder.has(f) for f in WEIGHT_FILES):
        raise NanoEvalError(
            f"checkpoint {path} has no weights (looked for {', '.join(WEIGHT_FILES)}). "
            "Fix: point --checkpoint at a folder saved with save_pretrained, or finish copying the checkpoint."
        )
    configs = {name: read_json_file(folder, name, "model configuration") for name in CONFIG_FILES
               if folder.has(name)}
    if "model_type" not in configs["config.json"]:
        raise NanoEvalError(f"checkpoint {path}: {p / 'config.json'} has no model_type, so transformers cannot tell "
                            "which model it is. Fix: restore config.json from the run that saved the checkpoint.")
    eos = configs.get("generation_config.json", {}).get("eos_token_id")
    if eos is not None and not all(type(i) is int and i >= 0 for i in (eos if isinstance(eos, list) else [eos])):
        raise CheckpointFileError(folder.root / "generation_config.json", f"has eos_token_id={eos!r:.100}, not a "
                                  "token id or a list of token ids", "correct eos_token_id (or remove it: the "
                                  "tokenizer's EOS is used)")
    files = weight_files(folder)
    check_safetensors([f for f in files if f.suffix == ".safetensors"], path)
    return folder
