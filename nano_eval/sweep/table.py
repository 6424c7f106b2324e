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
                             "stderr": _num(metrics.get(f"{metric}_stderr")), "error": ""})
    return rows


def _num(value) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


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
    followed or blocked on)."""
    from nano_eval.local_files import read_text

    from nano_eval.local_files import LocalFileError

    path = Path(out_dir) / CSV_NAME
    rows = list(csv.DictReader(io.StringIO(read_text(path, root=out_dir), newline="")))
    try:
        for r in rows:
            r["step"] = int(r["step"])
            r["consumed_tokens"] = int(r["consumed_tokens"]) if r["consumed_tokens"] else None
            r["value"] = float(r["value"]) if r["value"] else None
            r["stderr"] = float(r["stderr"]) if r["stderr"] else None
            r["error"] = r.get("error") or ""
            r["checkpoint"], r["task"], r["metric"] = r["checkpoint"] or "", r["task"] or "", r["metric"] or ""
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise LocalFileError(path, f"is not the table nano_eval wrote ({e})",
                             "remove it (the sweep writes it anew from the results files)") from None
    return rows


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
