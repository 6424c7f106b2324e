"""What makes two evaluations of a checkpoint the same: used to skip checkpoints a previous sweep already scored.

evaluation identity = hash(task keys in order, task versions, max_samples, seed, dtype, max_length, tokenizer,
results schema version, checkpoint fingerprint). Batch sizes and world size are left out: they never change scores.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from nano_eval.tracking.files import SCHEMA_VERSION

HEAD_BYTES = 1 << 20  # bytes read from the start of each weight / config file
READ_SUFFIXES = (".safetensors", ".bin", ".pt", ".json", ".yaml", ".distcp")


def fingerprint(path: str | Path) -> str:
    """A cheap content fingerprint of a checkpoint folder, subfolders included (nanotron keeps weights in model/):
    every file's relative path and size, plus the first MiB of weight and config files. Copying a checkpoint keeps
    it; rewriting its weights changes it."""
    root = Path(path)
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        digest.update(f"{rel}:{f.stat().st_size}\n".encode())
        if f.suffix in READ_SUFFIXES:
            with f.open("rb") as fh:
                digest.update(fh.read(HEAD_BYTES))
    return digest.hexdigest()[:16]


def evaluation_identity(args, task_keys: list[str], task_versions: dict[str, int], checkpoint_fingerprint: str) -> str:
    """Hex digest of everything that decides a checkpoint's scores (see the module docstring)."""
    parts = {
        "tasks": list(task_keys),
        "task_versions": dict(sorted(task_versions.items())),
        "max_samples": args.max_samples,
        "seed": args.seed,
        "dtype": args.dtype,
        "max_length": args.max_length,
        "tokenizer": args.tokenizer,
        "schema_version": SCHEMA_VERSION,
        "checkpoint": checkpoint_fingerprint,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
