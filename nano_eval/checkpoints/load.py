"""Load any saved checkpoint as a backend: the one place where a checkpoint format meets its reader.

Formats, in the order they are recognised: a torchtitan DCP checkpoint (`step-N/`: scored with torchtitan's own
model class, torchtitan.py), a nanotron checkpoint (`config.yaml` + `model/`), a Megatron iteration
folder or run dir (legacy `mp_rank_*` shards or torch_dist), else a transformers folder or Hub id. nanotron and
Megatron checkpoints are read into a transformers Llama (any machine); `backend="nanotron"` builds nanotron's own
model in a TP x PP layout instead (GPU + flash-attn), `backend="megatron"` megatron-core's GPTModel (dense or MoE)
in TP x PP x EP (megatron_native.py).

Also the one checkpoint fingerprint, used in results.json and to recognise a checkpoint a sweep already scored.
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from nano_eval.checkpoints.untrusted import CheckpointFileError, FilePolicy
from nano_eval.errors import NanoEvalError

HEAD_BYTES = 1 << 20  # bytes read from the start of each weight / config file
READ_SUFFIXES = (".safetensors", ".bin", ".pt", ".json", ".yaml", ".distcp")


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How to build the model behind an evaluation from a checkpoint."""

    backend: str = "transformers"  # "nanotron" / "megatron": the framework's own model class in tp x pp (x ep)
    tp: int = 1  # tensor-parallel degree (backends "nanotron", "megatron")
    pp: int = 1  # pipeline-parallel degree (backends "nanotron", "megatron")
    ep: int = 1  # expert-parallel degree (backend "megatron")
    tokenizer: str | None = None  # replaces the checkpoint's own (nanotron: config.yaml's; Megatron, torchtitan: required)
    torchtitan_config: str | None = None  # "MODULE:CONFIG" of a torchtitan checkpoint's model (its run's names)
    device: str = "cpu"
    dtype: str = "float32"  # "float32", "bfloat16" or "float16"
    max_length: int | None = None  # override the model's context length
    trust_remote_code: bool = False  # let a transformers checkpoint's own Python code run
    allow_symlinks_outside: bool = False  # follow symlinks out of the checkpoint / tokenizer folder
    max_checkpoint_bytes: int | None = None  # most bytes a checkpoint's model may allocate (None: physical memory)

    @property
    def policy(self) -> FilePolicy:
        return FilePolicy(allow_symlinks_outside=self.allow_symlinks_outside, max_bytes=self.max_checkpoint_bytes)


def load_backend(path: str, options: LoadOptions = LoadOptions()):
    """The backend holding the checkpoint at `path` (a folder, or a Hub id for transformers).

    Every failure is a NanoEvalError (exit code 2 on the command line, a failed checkpoint in a sweep): the
    loaders' own checks name the file and the fix; anything else a damaged file makes a framework raise is
    wrapped here, naming the checkpoint."""
    try:
        return _load(path, options)
    except NanoEvalError:
        raise
    except (Exception, RecursionError, MemoryError) as e:  # noqa: BLE001 -- a damaged file, seen from a framework
        text = " ".join(str(e).split())[:300] or repr(e)
        raise CheckpointFileError(path, f"could not be loaded ({type(e).__name__}: {text})",
                                  "copy the checkpoint again from the run that saved it; if it loads elsewhere, "
                                  "report this message") from e


def _load(path: str, o: LoadOptions):
    from nano_eval.checkpoints import megatron_legacy, nanotron, torchtitan
    from nano_eval.checkpoints.hf import load_transformers

    policy = o.policy
    if o.backend == "megatron":
        from nano_eval.checkpoints import megatron_native

        if not megatron_legacy.is_megatron_checkpoint(path):
            raise NanoEvalError(f"--backend megatron needs a Megatron checkpoint (an iter_XXXXXXX folder or its run "
                                f"dir): {path}")
        return megatron_native.load_native(path, o.tokenizer, tp=o.tp, pp=o.pp, ep=o.ep, dtype=o.dtype,
                                           max_length=o.max_length, device=o.device, policy=policy)
    if o.backend == "nanotron":
        if not nanotron.is_nanotron_checkpoint(path):
            raise NanoEvalError(f"--backend nanotron needs a nanotron checkpoint (config.yaml + model/): {path}")
        return nanotron.load_native(path, o.tokenizer, tp=o.tp, pp=o.pp, dtype=o.dtype, max_length=o.max_length,
                                    policy=policy)
    if torchtitan.is_torchtitan_checkpoint(path):
        return torchtitan.load_native(path, o.tokenizer, torchtitan_config=o.torchtitan_config, dtype=o.dtype,
                                      max_length=o.max_length, device=o.device, policy=policy)
    if nanotron.is_nanotron_checkpoint(path):
        return nanotron.load_as_transformers(path, o.tokenizer, device=o.device, dtype=o.dtype,
                                             max_length=o.max_length, policy=policy)
    if megatron_legacy.is_megatron_checkpoint(path):
        return megatron_legacy.load_as_transformers(path, o.tokenizer, device=o.device, dtype=o.dtype,
                                                    max_length=o.max_length, policy=policy)
    return load_transformers(path, device=o.device, dtype=o.dtype, max_length=o.max_length,
                             trust_remote_code=o.trust_remote_code, tokenizer=o.tokenizer, policy=policy)


def fingerprint(path: str | Path) -> str:
    """A cheap content fingerprint of a checkpoint folder, subfolders included (nanotron keeps weights in model/):
    every file's relative path and size, plus the first MiB of weight and config files. Copying a checkpoint keeps
    it; rewriting its weights changes it."""
    root = Path(path)
    digest = hashlib.sha256()
    entries = sorted(Path(top) / name for top, dirs, files in os.walk(root) for name in files)
    for f in entries:  # os.walk does not follow links: a symlink is fingerprinted by where it points, not read
        rel = f.relative_to(root).as_posix()
        st = os.lstat(f)
        if stat.S_ISLNK(st.st_mode):
            digest.update(f"{rel}->{os.readlink(f)}\n".encode())
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # a FIFO or device is refused by the loaders; never opened here
        digest.update(f"{rel}:{st.st_size}\n".encode())
        if f.suffix in READ_SUFFIXES:
            with f.open("rb") as fh:
                digest.update(fh.read(HEAD_BYTES))
    return digest.hexdigest()[:16]


def checkpoint_identity(path: str) -> dict:
    """What results.json says about the checkpoint: its resolved path and fingerprint (a Hub id: the id alone)."""
    p = Path(path)
    if not p.is_dir():
        return {"path": path}
    return {"path": str(p.resolve()), "fingerprint": fingerprint(p)}
