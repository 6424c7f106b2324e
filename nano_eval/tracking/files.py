"""Result files: written atomically so a crash or a kill never leaves a half-written file behind."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable

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


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict) -> None:
    atomic_write_text(path, json.dumps(_clean(data), indent=2, default=_json_default) + "\n")


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(_clean(r), default=_json_default) + "\n" for r in rows))


def details_file_name(task_key: str) -> str:
    """`suite|task:sub|5` -> `suite_task_sub_5.jsonl` (portable file names)."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in task_key) + ".jsonl"
