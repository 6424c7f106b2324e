"""The one results document (results.json) and how it is written, for the CLI, sweeps and the training hook.

    {schema_version, nano_eval_version, created, [step, consumed_tokens], [checkpoint], layout, config,
     task_versions, results, num_docs, skipped_docs, truncated_requests, timings, [failed_tasks], ...extra}

`results` is {task key: {metric: value, metric_stderr: value}}. Written by one rank (global rank 0, or the hook's
publishing rank): the details files first, results.json last, each atomically, so a results.json that exists
belongs to a finished evaluation.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

from nano_eval import __version__
from nano_eval.parallel import ParallelLayout
from nano_eval.tracking.files import SCHEMA_VERSION, details_file_name, write_json, write_jsonl


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
    })
    if getattr(results, "failed", None):
        doc["failed_tasks"] = dict(results.failed)  # task key -> why; these tasks have no scores above
    doc.update(extra or {})
    return doc


def write_results(out_dir: str | Path, document: dict, results, *, details: bool) -> Path:
    """Replace the evaluation in `out_dir`: `<out_dir>/details/<task>.jsonl` (per-sample rows, when `details`), then
    `<out_dir>/results.json`, so results.json and details/ always belong to the same evaluation.

    The old results.json goes first (a crash while writing leaves no results.json rather than one beside other
    details), then the new details files are written and every other `details/*.jsonl` is removed (an earlier
    evaluation's tasks, or all of them with details off), and results.json comes last. Other files in details/ are
    left alone. Details file names come from nano_eval.tracking.files.safe_file_name: a task key never names
    another folder."""
    out = Path(out_dir)
    (out / "results.json").unlink(missing_ok=True)
    written = set()
    if details:
        for key, tr in results.tasks.items():
            written.add(details_file_name(key))
            write_jsonl(out / "details" / details_file_name(key), tr.details)
    if (out / "details").is_dir():
        for stale in (out / "details").glob("*.jsonl"):
            if stale.name not in written:
                stale.unlink(missing_ok=True)
    write_json(out / "results.json", document)
    return out / "results.json"
