"""One evaluation of saved checkpoints, as `nano_eval eval` and `nano_eval sweep` run it: which tasks, how they are
scored, how the model is loaded and where the files go (`EvalJob`), and `evaluate_checkpoint`, the load -> score
-> write step both commands share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nano_eval.agreement import raise_together
from nano_eval.checkpoints.load import LoadOptions, checkpoint_identity, load_backend
from nano_eval.errors import TasksFailedError
from nano_eval.evaluator import EvalConfig, EvalResults, Evaluator
from nano_eval.tracking.results import results_document, write_results


@dataclass(frozen=True, kw_only=True)
class EvalJob:
    """Everything that decides what a command-line evaluation computes and writes (parsed once from argv)."""

    tasks: str  # "suite|task|k,..." or a file with one spec per line
    custom_tasks: str | None = None  # Python file defining TASKS_TABLE
    data_dir: str | None = None  # offline data mirror
    lm_eval_include_path: str | None = None  # folder of the user's own lm-eval task YAMLs (lm_eval|... specs)
    output_dir: str = "nano_eval_results"
    details: bool = True  # per-sample details files next to results.json
    eval: EvalConfig = field(default_factory=EvalConfig)
    load: LoadOptions = field(default_factory=LoadOptions)

    def config_section(self) -> dict[str, Any]:
        """The `config` section of results.json: the settings recorded with the scores."""
        return {
            "tasks": self.tasks,
            "lm_eval_include_path": self.lm_eval_include_path,
            "lm_eval_bootstrap_iters": self.eval.lm_eval_bootstrap_iters,
            "max_samples": self.eval.max_samples,
            "seed": self.eval.seed,
            "add_bos_token": self.eval.add_bos_token,
            "use_chat_template": self.eval.use_chat_template,
            "system_prompt": self.eval.system_prompt,
            "batch_tokens": self.eval.batching.max_batch_tokens,
            "max_batch_size": self.eval.batching.max_batch_size,
            "dtype": self.load.dtype,
            "max_length": self.load.max_length,
        }


def evaluate_checkpoint(job: EvalJob, tasks: list, checkpoint: str, out_dir: str | Path, *, step: int | None = None,
                        consumed_tokens: int | None = None, extra: Mapping[str, Any] | None = None) -> EvalResults:
    """Load `checkpoint`, score it on `tasks` ([(TaskSpec, Task)], loaded once by the caller), and on global rank 0
    write `<out_dir>/results.json` (+ details; see tracking.results.write_results). Every rank calls it; every rank
    returns the same results. The model is dropped on return.

    Tasks that fail while being scored are listed in results.json (`failed_tasks`) next to the others' scores, then
    TasksFailedError is raised on every rank (exit code 1; 2 when the model gave NaN / inf scores: a broken
    checkpoint is bad input). A fault on one rank (loading, preparing, scoring outside
    the forwards, rank 0's write) raises the same EvaluationFailed on every rank at the next point where the ranks
    meet (nano_eval.agreement), never at the process group's timeout."""
    backend = evaluator = error = None
    try:
        backend = load_backend(checkpoint, job.load)
        evaluator = Evaluator(backend, tasks, job.eval)
    except Exception as e:  # noqa: BLE001 -- raised on every rank together
        error = e
    raise_together(error)
    results = evaluator.evaluate(step=step)
    error = None
    try:
        if backend.layout.is_main:
            doc = results_document(results, layout=backend.layout, config=job.config_section(),
                                   checkpoint=checkpoint_identity(checkpoint), step=step,
                                   consumed_tokens=consumed_tokens, extra=extra)
            write_results(out_dir, doc, results, details=job.details, root=job.output_dir)
    except Exception as e:  # noqa: BLE001 -- raised on every rank together
        error = e
    raise_together(error)
    if results.failed and set(results.failed) == set(results.non_finite):  # the checkpoint is broken: bad input
        first, *more = results.non_finite
        raise TasksFailedError(
            results.failed[first]
            + (f" The same for {len(more)} more task(s): {', '.join(more)}." if more else "")
            + (f" The scores of the other {len(results.tasks)} task(s) are in {Path(out_dir) / 'results.json'}."
               if results.tasks else ""), bad_input=True)
    if results.failed:
        raise TasksFailedError(
            f"{len(results.failed)} task(s) failed while being scored: "
            + "; ".join(f"{k}: {why}" for k, why in results.failed.items())
            + f". The scores of the other {len(results.tasks)} task(s) are in {Path(out_dir) / 'results.json'}. "
            "Fix: the task's metric or data (traceback above), then rerun.")
    return results
