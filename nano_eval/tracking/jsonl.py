"""An append-only JSON-lines log that survives crashes: one `append` = one line, flushed and fsynced.

A kill during `append` can at worst leave the last line cut short; `read_jsonl` skips such a line (and only a
last line) so that everything appended before it stays readable.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nano_eval.tracking.files import _clean, _json_default


def append_jsonl(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append `row` as one line: a single write of the whole line, then flush and fsync (NaN/inf become null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(_clean(row), default=_json_default) + "\n"
    with path.open("a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete line of `path`; a cut-short last line (a crash during `append_jsonl`) is skipped."""
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1 and not line.endswith("\n"):
                break  # torn final write
            raise
    return rows
