"""The sweep loop: find finished checkpoints, evaluate each once (all tasks, one load), write, free, repeat.

Every rank runs the same loop. Rank 0 alone looks at the file system: it plans each round (what to evaluate, what
to reuse, whether to stop) and broadcasts the plan, so all ranks agree on the work; every rank evaluates (data
parallel); rank 0 writes `<out>/<checkpoint>/results.json`, the consolidated table, the report and the W&B rows.
A checkpoint whose results file carries the same evaluation identity (identity.py) is reused, not re-evaluated, so
a killed sweep restarts where it stopped. SIGINT / SIGTERM stop the loop after the checkpoint in progress
(`SweepSummary.signal` says which, for the exit code 128 + signal).

Faults: a checkpoint that fails to load or score is recorded (`SweepSummary.failed`, the table's `error` column, the
report, `eval/failed` in W&B) and skipped; the sweep goes on (and `--watch` keeps watching). The table is rewritten
after every checkpoint. The output folder is locked for the whole sweep and keeps the settings it was swept with
(lock.py): a second sweep into it stops with a message (or, with `wait`, polls until the first one ends, printing a
line on rank 0 every WAIT_REPORT_S), and one with other settings is refused.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from nano_eval.checkpoints.load import fingerprint
from nano_eval.errors import EvaluationFailed, NanoEvalError, TasksFailedError, is_rust_panic
from nano_eval.job import EvalJob, evaluate_checkpoint
from nano_eval.parallel import any_rank_true
from nano_eval.sweep.discovery import (Checkpoint, Settler, consumed_tokens, discover, has_marker, is_checkpoint_dir,
                                       missing_parts, select)
from nano_eval.sweep.identity import evaluation_identity, lm_eval_sources
from nano_eval.sweep.signals import StopFlag
from nano_eval.tracking.wandb_logger import WandbLogger, metric_key, one_line
from nano_eval.local_files import printable

WAIT_POLL_S, WAIT_REPORT_S = 2.0, 60.0  # --wait: how often to try the busy output folder's lock, and to say so


@dataclass(frozen=True, kw_only=True)
class SweepOptions:
    """Which checkpoints, how to wait for new ones, and where to log (what to evaluate: the EvalJob)."""

    run_dir: str
    every: int | None = None  # keep steps divisible by this
    min_step: int | None = None
    max_step: int | None = None
    last: int | None = None  # keep the last N (after the filters above)
    watch: bool = False  # keep polling for new checkpoints
    poll_s: float = 30.0
    settle_s: float = 5.0  # marker-less checkpoints must look unchanged this long before they are read
    until_step: int | None = None  # stop once a checkpoint at or past this step is done
    tokens_per_step: int | None = None  # consumed tokens = step x this, when the checkpoint does not say
    report: bool = True
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_run_id: str | None = None  # resume this run (e.g. the training run) instead of opening a new one
    wandb_run_name: str | None = None
    wandb_mode: str | None = None  # "offline" works without network
    wait: bool = False  # output folder busy with another sweep: wait for it to finish instead of stopping


@dataclass
class WorkItem:
    ckpt: Checkpoint
    identity: str
    fingerprint: str
    consumed_tokens: int | None
    reuse: bool  # results with this identity already exist
    blocked: str | None = None  # why its output folder cannot take results (then it fails without loading)


@dataclass
class Plan:
    work: list[WorkItem]
    wait_s: float | None  # sleep before planning again; None: nothing left to wait for
    stop: bool = False


@dataclass
class SweepSummary:
    evaluated: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)
    done: dict[int, Path] = field(default_factory=dict)  # step -> results.json
    failed: dict[int, tuple[str, str]] = field(default_factory=dict)  # step -> (checkpoint name, error)
    signal: int | None = None  # the signal (SIGINT / SIGTERM) that stopped the sweep early


def free_memory() -> None:
    """Return the last checkpoint's memory before the next one loads."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def finished_identity(results_path: Path, root: str | Path | None = None) -> str | None:
    """The evaluation identity of the results file (None if absent, or if some tasks failed: those are evaluated
    again). A file that cannot be used (not nano_eval's results: malformed, a FIFO, a symlink, too large; read by
    tracking.results.read_results, never followed or blocked on) counts as not done: a warning names it and the
    checkpoint is scored again (its folder is checked before that: output_problem)."""
    from nano_eval.local_files import LocalFileError
    from nano_eval.tracking.results import read_results

    try:
        doc = read_results(results_path, root=root)
    except FileNotFoundError:
        return None
    except (LocalFileError, OSError) as e:
        print(f"nano_eval: warning: {one_line(e, limit=1000)}; the checkpoint is scored again", file=sys.stderr,
              flush=True)
        return None
    return None if doc.get("failed_tasks") else (doc.get("sweep") or {}).get("evaluation_identity")


def output_problem(job: EvalJob, task_keys: list[str], name: str) -> Exception | None:
    """Why `<out>/<name>/` cannot take this checkpoint's results (a symlink, FIFO or folder where nano_eval writes:
    tracking.files.check_output_paths), or None. Checked when the checkpoint is planned, before it loads."""
    from nano_eval.tracking.files import check_output_paths
    from nano_eval.tracking.results import output_files

    try:
        check_output_paths(Path(job.output_dir) / name, root=job.output_dir,
                           files=output_files(task_keys, details=job.details))
    except NanoEvalError as e:
        return e
    return None


def evaluate_item(job: EvalJob, tasks: list, run_dir: Path, item: WorkItem) -> None:
    """Evaluate one checkpoint of a sweep into `<output_dir>/<checkpoint>/` (results.json with the sweep record:
    run dir, checkpoint name, kind, fingerprint, evaluation identity). Every rank calls it; rank 0 writes."""
    sweep = {"run_dir": str(Path(run_dir).resolve()), "checkpoint_name": item.ckpt.name, "kind": item.ckpt.kind,
             "fingerprint": item.fingerprint, "evaluation_identity": item.identity}
    evaluate_checkpoint(job, tasks, str(item.ckpt.path), Path(job.output_dir) / item.ckpt.name,
                        step=item.ckpt.step, consumed_tokens=item.consumed_tokens, extra={"sweep": sweep})
    # write_results replaces the folder's evaluation: no stale details from an older one stay


class SweepRunner:
    """Build once (tasks loaded and parsed), then `run()`."""

    def __init__(self, job: EvalJob, options: SweepOptions,
                 after_checkpoint: Callable[[Checkpoint, bool], None] | None = None):
        from dataclasses import replace

        from nano_eval.tasks import load_tasks

        if not job.tasks:
            raise NanoEvalError("a sweep needs --tasks. Fix: --tasks 'suite|task|k,...' (see --list-tasks).")
        self.job = replace(job, eval=replace(job.eval, progress=False))
        self.options, self.after_checkpoint = options, after_checkpoint
        self.run_dir, self.out = Path(options.run_dir), Path(job.output_dir)
        if not self.run_dir.is_dir():
            raise NanoEvalError(f"run directory {self.run_dir} does not exist. Fix: pass the folder holding the "
                                "checkpoints (nanotron <step>/, Megatron iter_*/, HF checkpoint-*/).")
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.sources = lm_eval_sources(job.lm_eval_include_path)  # the task files as these tasks load them
        self.tasks = load_tasks(job.tasks, custom_tasks=job.custom_tasks, data_dir=job.data_dir,
                                lm_eval_include_path=job.lm_eval_include_path)
        self.task_keys = [spec.key for spec, _ in self.tasks]
        self.versions = {spec.key: task.version for spec, task in self.tasks}
        self.settler = Settler(options.settle_s)
        self.handled: set[Path] = set()
        self.summary = SweepSummary()
        self.wandb: WandbLogger | None = None

    # ---- the loop -------------------------------------------------------------------------------------------------

    def run(self) -> SweepSummary:
        """Evaluate until nothing is left (one-shot) or until stopped (watch). Every rank calls it."""
        from nano_eval.sweep.report import write_report
        from nano_eval.sweep.table import write_table

        with StopFlag() as stop, self._claim_output(stop) as claimed:
            try:
                if not claimed:  # stopped (SIGINT / SIGTERM) while waiting for the output folder
                    self.summary.signal = stop.signum or signal.SIGTERM
                    return self.summary
                self.wandb = self._open_wandb() if self.is_main else None
                self._loop(stop)
            finally:
                if self.is_main and (self.summary.done or self.summary.failed):
                    write_table(self.summary.done, self.out, self.summary.failed)
                    if self.options.report:
                        write_report(self.out)
                    if self.wandb is not None:
                        self._log_signal_table()
                if self.wandb is not None:
                    self.wandb.close()
            if stop.requested:
                self.summary.signal = stop.signum or signal.SIGTERM  # another rank got it: torchrun forwards SIGTERM
        return self.summary

    @contextlib.contextmanager
    def _claim_output(self, stop: StopFlag):
        """Rank 0 locks the output folder and checks its settings (lock.py); every rank raises the same error if
        that fails, so no rank is left waiting in a collective. With `wait`, a folder busy with another sweep is
        tried again every WAIT_POLL_S (all ranks loop together, each round agreed by a broadcast, so none waits in
        one collective longer than that). Yields True once claimed, False if a signal stopped the wait."""
        from nano_eval.sweep.identity import identity_settings
        from nano_eval.sweep.lock import OutputBusy, OutputLock, check_settings

        waited_since = last_said = None
        with contextlib.ExitStack() as stack:
            while True:
                error, owner = None, None
                if self.is_main:
                    try:
                        stack.enter_context(OutputLock(self.out))
                        check_settings(self.out, identity_settings(self.job, self.task_keys, self.versions,
                                                                   self.sources))
                    except OutputBusy as e:
                        error, owner = str(e), (e.owner if self.options.wait else None)
                    except NanoEvalError as e:
                        error = str(e)
                if self.world > 1:
                    box = [(error, owner)]
                    dist.broadcast_object_list(box, src=0)
                    error, owner = box[0]
                if owner is None:
                    break
                now = time.monotonic()
                waited_since = waited_since or now
                if self.is_main and (last_said is None or now - last_said >= WAIT_REPORT_S):
                    last_said = now
                    print(f"nano_eval: waiting for the sweep that holds {printable(str(self.out))} ({owner}) to "
                          f"finish (--wait; "
                          f"{now - waited_since:.0f}s so far)", flush=True)
                stop.sleep(WAIT_POLL_S)
                if self._any_rank(stop.requested):
                    yield False
                    return
            if error is not None:
                raise NanoEvalError(error)
            yield True

    def _loop(self, stop: StopFlag) -> None:
        from nano_eval.sweep.report import write_report
        from nano_eval.sweep.table import write_table

        if self.is_main and self.options.watch:
            print(f"nano_eval: watching {printable(str(self.run_dir))} every {self.options.poll_s:g}s (stop: "
                  f"Ctrl-C / SIGTERM"
                  + (f", or once step {self.options.until_step} is done)" if self.options.until_step else ")"),
                  flush=True)
        while True:
            plan = self._agree(self._plan if self.is_main else None, stop.requested)
            finished = plan.stop
            for item in plan.work:
                self._process(item)
                if self.is_main:  # a killed sweep still leaves an up-to-date table
                    write_table(self.summary.done, self.out, self.summary.failed)
                reached = self.options.until_step is not None and item.ckpt.step >= self.options.until_step
                if reached or self._any_rank(stop.requested):
                    finished = True
                    break
            if plan.work and self.is_main and self.options.watch and self.options.report:
                write_report(self.out)
            if finished or plan.wait_s is None:
                return
            stop.sleep(plan.wait_s)

    def _any_rank(self, flag: bool) -> bool:
        if not dist.is_initialized():
            return flag
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return any_rank_true(flag, dist.group.WORLD, self.world, device=device)

    def _agree(self, make_plan: Callable[[bool], Plan] | None, stop_requested: bool) -> Plan:
        """Rank 0 plans, every rank receives the same plan (a signal on any rank stops all of them)."""
        stop = self._any_rank(stop_requested)
        plan = make_plan(stop) if make_plan is not None else None
        if self.world > 1:
            box = [plan]
            dist.broadcast_object_list(box, src=0)
            plan = box[0]
        return plan

    # ---- planning (rank 0) ----------------------------------------------------------------------------------------

    def _plan(self, stop: bool) -> Plan:
        if stop:
            return Plan([], None, stop=True)
        o = self.options
        found = select(discover(self.run_dir), every=o.every, min_step=o.min_step, max_step=o.max_step, last=o.last)
        if not found and not o.watch:
            hint = (f"it is itself one checkpoint: evaluate it with `nano_eval --checkpoint {self.run_dir}`"
                    if is_checkpoint_dir(self.run_dir) else
                    "pass a run directory holding <step>/, iter_*/ or checkpoint-*/ folders (torchtitan: its dump folder, "
                    "holding checkpoint/step-N/), or use --watch")
            raise NanoEvalError(f"no checkpoints found under {self.run_dir} (after the step selection). Fix: {hint}.")
        work, settling = [], []
        for ckpt in found:
            if ckpt.path in self.handled:
                continue
            why = missing_parts(ckpt, self.run_dir)
            if why is not None:
                if not o.watch:  # never read a half-written checkpoint; a one-shot sweep leaves it
                    self._skip_incomplete(ckpt, why)
                continue
            if has_marker(ckpt, self.run_dir) or self.settler.settled(ckpt):
                work.append(self._work_item(ckpt))
            else:
                settling.append(ckpt)
        if o.watch:
            return Plan(work, o.poll_s)
        wait = min((self.settler.wait_s(c) for c in settling), default=None)
        return Plan(work, None if wait is None else wait + 0.05)

    def _skip_incomplete(self, ckpt: Checkpoint, why: str) -> None:
        self.handled.add(ckpt.path)
        self.summary.incomplete.append(ckpt.name)
        print(f"nano_eval: warning: skipping checkpoint {ckpt.shown_path}: not finished ({printable(why)}). "
              f"Fix: rerun the sweep once "
              "it is written, or use --watch to wait for it.", file=sys.stderr, flush=True)

    def _work_item(self, ckpt: Checkpoint) -> WorkItem:
        fp = fingerprint(ckpt.path)
        identity = evaluation_identity(self.job, self.task_keys, self.versions, fp, self.sources)
        tokens = consumed_tokens(ckpt)
        if tokens is None and self.options.tokens_per_step:
            tokens = ckpt.step * self.options.tokens_per_step
        reuse = self._existing_identity(ckpt) == identity
        problem = None if reuse else output_problem(self.job, self.task_keys, ckpt.name)
        return WorkItem(ckpt, identity, fp, tokens, reuse=reuse, blocked=None if problem is None else str(problem))

    def _existing_identity(self, ckpt: Checkpoint) -> str | None:
        return finished_identity(self.out / ckpt.name / "results.json", root=self.out)

    # ---- one checkpoint -------------------------------------------------------------------------------------------

    def _process(self, item: WorkItem) -> None:
        ckpt = item.ckpt
        self.handled.add(ckpt.path)
        if item.reuse:
            self.summary.reused.append(ckpt.name)
            if self.is_main:
                print(f"nano_eval: {ckpt.shown} (step {ckpt.step}): already evaluated, reusing its results",
                      flush=True)
        elif item.blocked is not None:  # its output folder cannot take results: failed without loading it
            self._record_failure(item, NanoEvalError(item.blocked))
            return
        else:
            start = time.perf_counter()
            error = self._evaluate(item)
            if error is not None:
                self._record_failure(item, error)
                if not os.path.lexists(self.out / ckpt.name / "results.json") or \
                        not isinstance(error, TasksFailedError):
                    return
            else:
                self.summary.evaluated.append(ckpt.name)
                if self.is_main:
                    print(f"nano_eval: {ckpt.shown} (step {ckpt.step}): evaluated in "
                          f"{time.perf_counter() - start:.1f}s", flush=True)
        results_path = self.out / ckpt.name / "results.json"
        self.summary.done[ckpt.step] = results_path
        # A new W&B run gets the whole curve (reused results too); a resumed run only what this sweep adds.
        if self.is_main and self.wandb is not None and (not item.reuse or not self.options.wandb_run_id):
            self._log_wandb(results_path)
        if self.after_checkpoint is not None:
            self.after_checkpoint(ckpt, item.reuse)

    def _evaluate(self, item: WorkItem) -> Exception | None:
        """Load once, score every task, write (rank 0), then drop every reference to the model. Returns the error
        if the checkpoint failed on any rank (every rank agrees), else None.

        A fault on one rank outside the forwards ends the checkpoint on every rank at the next point where the ranks
        meet (nano_eval.agreement: EvaluationFailed everywhere). Limitation: a fault inside a forward (one rank out of
        memory halfway through a collective) leaves the others in that collective until --dist-timeout."""
        error = None
        try:
            evaluate_item(self.job, self.tasks, self.run_dir, item)
        except dist.DistBackendError:
            raise  # a rank that does not answer is not this checkpoint's fault: the command reports it
        except BaseException as e:  # noqa: BLE001 -- recorded and skipped: one broken checkpoint never stops a sweep
            if not isinstance(e, Exception) and not is_rust_panic(e):
                raise  # Ctrl-C, SystemExit; a Rust library's panic (a checkpoint's tokenizer) is the checkpoint's
            if dist.is_initialized() and "gloo" in str(e).lower() and "timed out" in str(e).lower():
                raise  # gloo's collective timeout is a plain RuntimeError
            error = e
        free_memory()
        if self._any_rank(error is not None) and error is None:
            error = RuntimeError("failed on another rank (see its error above)")
        return error

    def _record_failure(self, item: WorkItem, error: Exception) -> None:
        ckpt = item.ckpt
        message = " ".join(str(error).split()) if isinstance(error, NanoEvalError) else one_line(error, limit=1000)
        self.summary.failed[ckpt.step] = (ckpt.name, message)
        cause = error.__cause__ if isinstance(error, EvaluationFailed) else None
        if isinstance(cause, Exception) and not isinstance(cause, NanoEvalError):
            traceback.print_exception(cause)  # on the rank whose bug it is
        if not self.is_main:
            return
        if not isinstance(error, NanoEvalError):
            traceback.print_exception(error)
        print(f"nano_eval: error: checkpoint {ckpt.shown_path} (step {ckpt.step}) failed: {printable(message)}; "
              f"skipped, the sweep "
              "goes on", file=sys.stderr, flush=True)
        if self.wandb is not None:
            self.wandb.log({"eval/failed": 1}, step=ckpt.step, consumed_tokens=item.consumed_tokens)

    # ---- W&B (rank 0) ---------------------------------------------------------------------------------------------

    def _open_wandb(self) -> WandbLogger | None:
        o = self.options
        if not (o.wandb_project or o.wandb_run_id):
            return None
        init = {"id": o.wandb_run_id, "resume": "allow"} if o.wandb_run_id else {}
        logger = WandbLogger(enabled=True, project=o.wandb_project, entity=o.wandb_entity, name=o.wandb_run_name,
                             mode=o.wandb_mode, dir=str(self.out), init_kwargs=init,
                             run_config={"run_dir": str(self.run_dir), "tasks": self.task_keys,
                                         "max_samples": self.job.eval.max_samples})
        return logger

    def _log_signal_table(self) -> None:
        """The ranked trend / noise table (sweep_signal.csv, snr.py part 2) as the W&B table
        `sweep/signal_to_noise` (its name kept for existing dashboards)."""
        from nano_eval.sweep.snr import COLUMNS, ranked, signal_rows
        from nano_eval.sweep.table import table_rows

        stats = signal_rows(ranked(table_rows(self.summary.done, root=self.out)))
        self.wandb.log_table("sweep/signal_to_noise", COLUMNS, [[printable(r[c]) if isinstance(r[c], str) else r[c]
                                                                  for c in COLUMNS] for r in stats])

    def _log_wandb(self, results_path: Path) -> None:
        from nano_eval.local_files import LocalFileError
        from nano_eval.tracking.results import read_results

        try:
            doc = read_results(results_path, root=self.out)
        except (OSError, LocalFileError) as e:
            print(f"nano_eval: warning: not logged to W&B: {one_line(e, limit=1000)}", file=sys.stderr, flush=True)
            return
        flat = {metric_key("eval", task, name): value for task, metrics in doc["results"].items()
                for name, value in metrics.items() if not name.endswith("_stderr") and value is not None}
        flat["eval/failed"] = 1 if doc.get("failed_tasks") else 0
        if isinstance(doc.get("step"), int):
            self.wandb.log(flat, step=doc["step"], consumed_tokens=doc.get("consumed_tokens"))
