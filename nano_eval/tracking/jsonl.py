"""An append-only JSON-lines log that survives crashes: one `append` = one line, flushed and fsynced.

A kill during `append` can at worst leave the last line cut short; `read_jsonl` skips such a line (and only a
last line) so that everything appended before it stays readable.
"""

from __future__ import annotations

import json
import os
from typing import Any

from nano_eval.local_files import TEXT_BYTES, LocalFileError, append_text, read_text
from nano_eval.tracking.files import _clean, _json_default


def append_jsonl(path: str | os.PathLike, row: dict[str, Any], *, root: str | os.PathLike | None = None) -> None:
    """Append `row` as one line: a single write of the whole line, then fsync (NaN/inf become null). The file is
    opened as local_files.append_text does (no symlink followed, a FIFO refused instead of blocking; folders below
    `root` must be real)."""
    append_text(path, json.dumps(_clean(row), default=_json_default) + "\n", root=root)


def read_jsonl(path: str | os.PathLike, *, root: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Every complete line of the regular file `path` (read as local_files.read_text: bounded, never blocking); a
    cut-short last line (a crash during `append_jsonl`) is skipped; any other line that is not a JSON object is a
    LocalFileError naming the file and the line."""
    lines = read_text(path, TEXT_BYTES, root=root).splitlines(keepends=True)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # torn final write
            raise LocalFileError(path, f"line {i + 1} is not JSON", "remove the line or the file") from None
        if not isinstance(row, dict):
            raise LocalFileError(path, f"line {i + 1} is not a JSON object", "remove the line or the file")
        rows.append(row)
    return rows
