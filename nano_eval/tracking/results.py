"""The one results document (results.json) and how it is written, for the CLI, sweeps and the training hook.

    {schema_version, nano_eval_version, created, [step, consumed_tokens], [checkpoint], layout, config,
     task_versions, results, num_docs, skipped_docs, truncated_requests, timings, positions, [failed_tasks],
     ...extra}

`results` is {task key: {metric: value, metric_stderr: value}}. `positions` is the scoring work per request type,
summed over data-parallel ranks: {"loglikelihood": {forwards, positions (rows x columns given to the model), padding
(of those positions), output_positions (projected through the output layer)}}. Written by one rank (global rank 0, or the hook's
publishing rank): every file to a temporary name first, then renamed into place, results.json last, so a
results.json that exists belongs to a finished evaluation and a failed write keeps the old one (write_results).
"""

from __future__ import annotations

import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from nano_eval import __version__
from nano_eval.parallel import ParallelLayout
from nano_eval.tracking.files import SCHEMA_VERSION, details_file_name, json_bytes, jsonl_bytes


def results_document(results, *, layout: ParallelLayout, config: Mapping[str, Any], checkpoint: dict | None = None,
                     step: int | None = None, consumed_tokens: int | None = None,
                     extra: Mapping[str, Any] | None = None) -> dict:
    """The results.json document of one evaluation.

    results: an EvalResults (nano_eval.evaluator): `.tasks` {task key: TaskResult}, `.timings`.
    config: the settings that decided the scores (tasks, max_samples, seed, ...), as the caller names them.
    step / consumed_tokens: where in training the model was (in-training evaluations and sweeps).
    extra: more top-level keys (the hook's skipped_tasks, a sweep's identity section)."""
    tasks = results.tasks
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "nano_eval_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if step is not None:
        doc.update(step=step, consumed_tokens=consumed_tokens)
    if checkpoint is not None:
        doc["checkpoint"] = checkpoint
    doc.update({
        "layout": layout.describe(),
        "config": dict(config),
        "task_versions": {k: tr.version for k, tr in tasks.items()},
        "results": {k: tr.metrics for k, tr in tasks.items()},
        "num_docs": {k: tr.num_docs for k, tr in tasks.items()},
        "skipped_docs": {k: tr.skipped_docs for k, tr in tasks.items()},
        "truncated_requests": {k: tr.truncated_requests for k, tr in tasks.items()},
        "timings": results.timings,
        "positions": getattr(results, "work", {}),
    })
    if getattr(results, "failed", None):
        doc["failed_tasks"] = dict(results.failed)  # task key -> why; these tasks have no scores above
    doc.update(extra or {})
    return doc


def output_files(task_keys, *, details: bool) -> list[str]:
    """The files one evaluation writes in its folder, relative to it: results.json and details/<task>.jsonl."""
    return ["results.json", *(f"details/{details_file_name(k)}" for k in task_keys if details)]


def write_results(out_dir: str | Path, document: dict, results, *, details: bool,
                  root: str | Path | None = None) -> Path:
    """Replace the evaluation in `out_dir` so that results.json and details/ always belong to the same evaluation,
    and a failure never loses the old results.

    1. Every new file is written to a temporary name first (`details/.<task>.jsonl.<random>.tmp`,
       `.results.json.<random>.tmp`), fsynced; every name to be replaced is checked (no folder, FIFO or device there;
       no symlinked folder between `root` and `out_dir`: local_files). A failure here (a bad entry, a full disk)
       removes the temporary files and leaves the old evaluation as it was.
    2. Then only renames and unlinks: the old results.json goes, the new details files take their names, every
       other `details/*.jsonl` file (an earlier evaluation's tasks, or all of them with details off) is removed,
       and results.json comes last. A crash between these renames leaves no results.json (never one beside
       other details).
    Other entries of details/ are left alone. `root`: the output folder the user named (default: `out_dir`); a
    sweep's or the hook's per-checkpoint folders are below it. Details file names come from
    tracking.files.safe_file_name: a task key never names another folder."""
    from nano_eval.local_files import entry_kind, move_into_place, real_dir, remove_file, write_temporary

    out = Path(out_dir)
    root = Path(root) if root is not None else out
    real_dir(out, root=root, create=True)
    if details or os.path.lexists(out / "details"):
        real_dir(out / "details", root=root, create=details)
    prepared: list[tuple[Path, Path]] = []  # (temporary file, final name)
    try:
        if details:
            for key, tr in results.tasks.items():
                name = out / "details" / details_file_name(key)
                prepared.append((write_temporary(name, jsonl_bytes(tr.details), root=root), name))
        prepared.append((write_temporary(out / "results.json", json_bytes(document), root=root),
                         out / "results.json"))
        # step 2: only renames and unlinks from here on
        remove_file(out / "results.json", root=root)
        for tmp, name in prepared[:-1]:
            move_into_place(tmp, name)
        written = {name.name for _, name in prepared[:-1]}
        if (out / "details").is_dir():
            for stale in (out / "details").glob("*.jsonl"):
                if stale.name not in written and entry_kind(stale) in ("regular file", "symlink"):
                    remove_file(stale, root=root)
        move_into_place(*prepared[-1])
    except BaseException:
        for tmp, _ in prepared:
            Path(tmp).unlink(missing_ok=True)
        raise
    return out / "results.json"


def read_results(path: str | Path, *, root: str | Path | None = None) -> dict:
    """A results.json written by nano_eval, read back safely (local_files.read_json: a regular file, bounded, no
    symlink below `root`) and checked for the shape the sweep's table, W&B rows and reuse decisions rely on.
    Raises LocalFileError naming the file (FileNotFoundError when it is missing)."""
    from nano_eval.local_files import LocalFileError, read_json

    doc = read_json(path, root=root)

    def bad(what: str):
        return LocalFileError(path, f"is not a results file nano_eval wrote ({what})",
                              "remove it (it is scored again), or put the file nano_eval wrote there back")

    results = doc.get("results")
    if not isinstance(results, dict) or not all(
            isinstance(m, dict) and all(isinstance(k, str) and (v is None or isinstance(v, float)
                                                                    or (isinstance(v, int) and not isinstance(v, bool)
                                                                        and abs(v) < 2 ** 63))
                                        for k, v in m.items()) for m in results.values()):
        raise bad("`results` must map each task to {metric: number}")
    for key, kind in (("step", int), ("consumed_tokens", int), ("failed_tasks", dict), ("sweep", dict)):
        value = doc.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise bad(f"`{key}` must be a JSON {'integer' if kind is int else 'object'}")
        if kind is int and value is not None and not 0 <= value < 2 ** 63:
            raise bad(f"`{key}` must be an integer between 0 and 2^63")
    sweep = doc.get("sweep") or {}
    for key in ("evaluation_identity", "checkpoint_name"):
        if key in sweep and not isinstance(sweep[key], str):
            raise bad(f"`sweep.{key}` must be a string")
    return doc
