"""The consolidated sweep table: one row per (checkpoint, task, metric), in step order, as CSV and parquet; and next
to it the signal table (snr.py): one row per (task, metric), improving curves first, ranked by trend / noise.

Built from the per-checkpoint results.json files only, so a restarted sweep rebuilds exactly the same table. A
checkpoint that failed (to load, or some of its tasks to score) adds one row whose `error` column says why (task and
metric empty); every other row has an empty `error`.
"""

from __future__ import annotations

import csv
import io
import math
import sys
from pathlib import Path

from nano_eval.sweep.snr import COLUMNS as SIGNAL_COLUMNS
from nano_eval.sweep.snr import ranked, signal_rows
from nano_eval.tracking.files import atomic_write_bytes, atomic_write_text
from nano_eval.local_files import printable

COLUMNS = ("checkpoint", "step", "consumed_tokens", "task", "metric", "value", "stderr", "error")
CSV_NAME, PARQUET_NAME = "sweep_results.csv", "sweep_results.parquet"
MAX_STEP = 2 ** 63 - 1  # steps and token counts are int64 (the parquet table's type)
MAX_VALUE = 1e100  # |value| and stderr: far past any metric, and the comparisons' squares and sums stay finite
SIGNAL_CSV_NAME, SIGNAL_PARQUET_NAME = "sweep_signal.csv", "sweep_signal.parquet"


def table_rows(done: dict[int, Path], failed: dict[int, tuple[str, str]] | None = None,
               root: str | Path | None = None) -> list[dict]:
    """Rows of every finished checkpoint (step -> its results.json), in step order, then task and metric order;
    a failed checkpoint (step -> (name, error)) adds its error row first. The results files are read by
    tracking.results.read_results (below `root`, the output folder): one that cannot be read any more becomes the
    checkpoint's error row, naming the file."""
    from nano_eval.local_files import LocalFileError
    from nano_eval.tracking.results import read_results

    rows = []
    failed = dict(failed or {})
    docs = {}
    for step, path in done.items():
        try:
            docs[step] = read_results(path, root=root)
        except (OSError, LocalFileError) as e:
            failed.setdefault(step, (Path(path).parent.name, " ".join(str(e).split())))
    for step in sorted(set(done) | set(failed)):
        if step in failed:
            name, error = failed[step]
            rows.append({"checkpoint": name, "step": step, "consumed_tokens": None, "task": "", "metric": "",
                         "value": None, "stderr": None, "error": error})
        if step not in docs:
            continue
        doc = docs[step]
        name = (doc.get("sweep") or {}).get("checkpoint_name", Path(done[step]).parent.name)
        for task, metrics in doc["results"].items():
            for metric, value in metrics.items():
                if metric.endswith("_stderr"):
                    continue
                rows.append({"checkpoint": name, "step": step, "consumed_tokens": doc.get("consumed_tokens"),
                             "task": task, "metric": metric, "value": _num(value),
                             "stderr": _num(metrics.get(f"{metric}_stderr"), minimum=0.0), "error": ""})
    return rows


def _num(value, minimum: float = -MAX_VALUE) -> float | None:
    """A metric value for the table: None for a missing one, and for one read_table would refuse (NaN: no stderr;
    inf, past MAX_VALUE or a negative stderr: nano_eval never scores it)."""
    if value is None or not math.isfinite(float(value)) or not minimum <= float(value) <= MAX_VALUE:
        return None
    return float(value)


def csv_text(columns: tuple[str, ...], rows: list[dict]) -> str:
    """CSV of `rows` (dicts keyed by `columns`), a header first; None is written as an empty field."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def write_table(done: dict[int, Path], out_dir: str | Path, failed: dict[int, tuple[str, str]] | None = None) -> Path:
    """Write `sweep_results.csv` (and `.parquet` when pyarrow imports) atomically, each through a uniquely named
    temporary file (tracking.files.atomic_write_bytes); returns the CSV path."""
    out = Path(out_dir)
    rows = table_rows(done, failed, root=out)
    atomic_write_text(out / CSV_NAME, csv_text(COLUMNS, rows), root=out)
    _write_parquet(rows, out / PARQUET_NAME)
    write_signal_table(rows, out)
    return out / CSV_NAME


def write_signal_table(rows: list[dict], out_dir: str | Path) -> Path:
    """`sweep_signal.csv` (+ `.parquet` when pyarrow imports): snr.ranked(rows), one row per task x metric,
    improving curves first, the largest trend / noise first; returns the CSV path."""
    out = Path(out_dir)
    stats = signal_rows(ranked(rows))
    atomic_write_text(out / SIGNAL_CSV_NAME, csv_text(SIGNAL_COLUMNS, stats), root=out)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return out / SIGNAL_CSV_NAME  # _write_parquet has said so for the main table
    types = {"rank": pa.int64(), "task": pa.string(), "metric": pa.string(), "direction": pa.string(),
             "checkpoints": pa.int64(), "x": pa.string()}
    schema = pa.schema([(c, types.get(c, pa.float64())) for c in SIGNAL_COLUMNS])
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(stats, schema=schema), buffer)
    atomic_write_bytes(out / SIGNAL_PARQUET_NAME, buffer.getvalue(), root=out)
    return out / SIGNAL_CSV_NAME


def _write_parquet(rows: list[dict], path: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        print(f"nano_eval: warning: {printable(path.name)} skipped ({printable(str(e))}); the CSV has the same "
              f"rows", file=sys.stderr)
        return
    schema = pa.schema([("checkpoint", pa.string()), ("step", pa.int64()), ("consumed_tokens", pa.int64()),
                        ("task", pa.string()), ("metric", pa.string()), ("value", pa.float64()),
                        ("stderr", pa.float64()), ("error", pa.string())])
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buffer)
    atomic_write_bytes(path, buffer.getvalue(), root=path.parent)


def read_table(out_dir: str | Path) -> list[dict]:
    """The CSV back as typed rows (None for missing numbers), read as local_files.read_text (a regular file, never
    followed or blocked on). Another run's table is untrusted input (`nano_eval compare`): it must be the table
    nano_eval writes (these columns; steps and token counts integers in [0, 2^63); values and stderrs finite, within
    MAX_VALUE, stderrs >= 0; no row longer than the header), else a LocalFileError naming the file and row."""
    from nano_eval.local_files import LocalFileError, read_text

    path = Path(out_dir) / CSV_NAME
    fix = "remove it (the sweep writes it anew from the results files), or compare the sweeps' own output folders"
    line = 0
    try:
        reader = csv.DictReader(io.StringIO(read_text(path, root=out_dir), newline=""))
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"no column {', '.join(missing)}")
        rows = []
        for line, r in enumerate(reader, start=1):
            rows.append(r)
            if None in r:
                raise ValueError("a row with more fields than columns")
            r["step"] = _count(r["step"], "step")
            r["consumed_tokens"] = _count(r["consumed_tokens"], "consumed_tokens") if r["consumed_tokens"] else None
            r["value"] = _finite(r["value"], "value") if r["value"] else None
            r["stderr"] = _finite(r["stderr"], "stderr", minimum=0.0) if r["stderr"] else None
            r["error"] = r.get("error") or ""
            r["checkpoint"], r["task"], r["metric"] = r["checkpoint"] or "", r["task"] or "", r["metric"] or ""
    except (KeyError, TypeError, ValueError, AttributeError, csv.Error) as e:
        where = f"row {line}" if line else "header"
        raise LocalFileError(path, f"is not the table nano_eval wrote ({where}: {e})", fix) from None
    return rows


def _count(text: str, column: str) -> int:
    """A step or token count: decimal digits, 0 <= n < 2^63."""
    text = text.strip()
    if not (text.isascii() and text.isdigit() and len(text) <= 19 and int(text) <= MAX_STEP):
        raise ValueError(f"{column} {text[:30]!r} is not an integer between 0 and 2^63")
    return int(text)


def _finite(text: str, column: str, minimum: float = -MAX_VALUE) -> float:
    """A value or stderr: a finite number in [minimum, MAX_VALUE] (no NaN, inf or 1e999)."""
    value = float(text)
    if not (math.isfinite(value) and minimum <= value <= MAX_VALUE):
        raise ValueError(f"{column} {text.strip()[:30]!r} is not a finite number between {minimum:g} and "
                         f"{MAX_VALUE:g}")
    return value


TERMINAL_CHECKPOINTS = 8  # the terminal table shows the last 8 checkpoints; sweep_results.csv holds them all


def text_table(rows: list[dict], last: int = TERMINAL_CHECKPOINTS) -> str:
    """The table for the terminal, as narrow as the run allows: one line per task x metric, one column per
    checkpoint (its step; the last `last` checkpoints in step order, the rest left to sweep_results.csv), values
    with 4 decimals; then one line per failed checkpoint with its error."""
    steps = sorted({r["step"] for r in rows})
    shown = steps[-last:]
    keys = list(dict.fromkeys((r["task"], r["metric"]) for r in rows if r["task"]))
    values = {(r["task"], r["metric"], r["step"]): "" if r["value"] is None else f"{r['value']:.4f}"
              for r in rows if r["task"]}
    header = ["task", "metric", *(f"step {s}" for s in shown)]
    table = [header] + [[task, metric, *(values.get((task, metric, s), "") for s in shown)] for task, metric in keys]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    text = ["  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
            .rstrip() for row in table]
    text.insert(1, "  ".join("-" * w for w in widths))
    if len(steps) > len(shown):
        text.append(f"(the last {len(shown)} of {len(steps)} checkpoints; every one is in {CSV_NAME})")
    errors = {r["step"]: (r["checkpoint"], r["error"]) for r in rows if r.get("error")}
    text += [f"step {step} ({name}) failed: {error}" for step, (name, error) in sorted(errors.items())]
    return "\n".join(text)
