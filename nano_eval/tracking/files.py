"""Result files: written atomically so a crash or a kill never leaves a half-written file behind.

`atomic_write_bytes` (from `nano_eval.local_files`, the rule for every file outside a checkpoint) is the one atomic
write of nano_eval (results, details, sweep tables and reports): a temporary file with a unique name in the real
target folder, fsynced, given the permissions the process umask allows (as a plain `open` would), then renamed over
the target. `safe_file_name` is the one filename sanitiser: names built from task keys or metric names never leave
the folder they are meant for.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

from nano_eval.local_files import atomic_write_bytes, current_umask  # noqa: F401  (the one atomic write)

SCHEMA_VERSION = 1


def _json_default(obj: Any):
    if hasattr(obj, "item"):  # numpy / torch scalars
        return obj.item()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    if isinstance(obj, Path):
        return str(obj)
    return repr(obj)


def _clean(value: Any) -> Any:
    """NaN and inf are not JSON: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def atomic_write_text(path: Path, text: str, *, root: str | Path | None = None) -> None:
    """`text` (UTF-8) written atomically to `path`; no folder between `root` (the output folder the user named;
    default: the file's folder) and the file may be a symlink (local_files.real_dir)."""
    atomic_write_bytes(path, text.encode("utf-8"), root=root)


def json_bytes(data: dict) -> bytes:
    """The bytes write_json writes (NaN / inf as null, indented, one trailing newline)."""
    return (json.dumps(_clean(data), indent=2, default=_json_default) + "\n").encode("utf-8")


def jsonl_bytes(rows: Iterable[dict]) -> bytes:
    """The bytes write_jsonl writes: one JSON object per line."""
    return "".join(json.dumps(_clean(r), default=_json_default) + "\n" for r in rows).encode("utf-8")


def write_json(path: Path, data: dict, *, root: str | Path | None = None) -> None:
    atomic_write_bytes(path, json_bytes(data), root=root)


def write_jsonl(path: Path, rows: Iterable[dict], *, root: str | Path | None = None) -> None:
    atomic_write_bytes(path, jsonl_bytes(rows), root=root)


MAX_NAME_CHARS = 120


def safe_file_name(name: str) -> str:
    """A portable file name (no folder part) from any text: `suite|task:sub|5` -> `suite_task_sub_5`.

    Every character but letters, digits, `-` and `.` becomes `_`, so `/`, `\\` and absolute paths cannot name
    another folder; a leading dot becomes `_` (no `..`, no hidden files); long names are cut and end in a hash."""
    safe = "".join(c if c.isalnum() or c in "-." else "_" for c in name)
    if not safe or safe.startswith("."):
        safe = "_" + safe
    if len(safe) > MAX_NAME_CHARS:
        safe = safe[: MAX_NAME_CHARS - 17] + "_" + hashlib.sha256(name.encode()).hexdigest()[:16]
    return safe


def details_file_name(task_key: str) -> str:
    """`suite|task:sub|5` -> `suite_task_sub_5.jsonl`."""
    return safe_file_name(task_key) + ".jsonl"


def check_output_paths(out_dir: str | Path, *, folders: Iterable[str] = (), files: Iterable[str] = (),
                       option: str = "--output-dir", root: str | Path | None = None) -> None:
    """Fail early, before any model loads, if the results could not be written, and create nothing.

    `out_dir` (below `root`, default: `out_dir` itself) and each of `folders` under it must be real folders or
    missing (local_files.real_dir: no symlink, file or FIFO in their place, so nothing is written into or deleted
    from another folder), and the deepest part of each that exists must take a probe file (written and removed);
    each of `files` under it (`results.json`, `details/<task>.jsonl`, ...) must be missing, a regular file or a
    symlink (replaced, never followed): a folder, FIFO or device there is refused. Raises NanoEvalError (one line
    naming the path and the fix; exit code 2)."""
    from nano_eval.errors import NanoEvalError
    from nano_eval.local_files import LocalFileError, check_file_slot, printable, real_dir

    out = Path(out_dir)
    root = Path(root) if root is not None else out
    fix = f"Fix: pass an {option} that names a folder you can write in (or move what is in the way)."
    probed = set()
    for folder in (out, *(out / name for name in folders)):
        try:
            real_dir(folder, root=root)
        except LocalFileError as e:
            raise NanoEvalError(f"{printable(e.path)} {printable(e.what)} ({option}). {fix}") from None
        existing = next(p for p in (folder, *folder.parents) if os.path.lexists(p))  # "." or "/" at the latest
        if existing == folder and not folder.is_dir():
            raise NanoEvalError(f"{printable(str(folder))} is a file, not a folder ({option}). {fix}")
        if not existing.is_dir():
            raise NanoEvalError(f"{printable(str(folder))} cannot be created: {printable(str(existing))} is a file, "
                                f"not a folder ({option}). {fix}")
        if existing in probed:
            continue
        probed.add(existing)
        try:
            fd, probe = tempfile.mkstemp(dir=existing, prefix=".nano_eval_write_check.")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise NanoEvalError(f"cannot write in {printable(str(existing))} ({e.strerror or e}) ({option}). "
                                f"{fix}") from None
    for name in files:
        try:
            check_file_slot(out / name, root=root)
        except LocalFileError as e:
            raise NanoEvalError(f"{printable(e.path)} {printable(e.what)} ({option}). {fix}") from None
