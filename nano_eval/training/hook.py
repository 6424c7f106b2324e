"""In-training evaluation: build once, then call from the training loop every N steps.

```python
hook = EvalHook(EvalHookConfig(tasks="demo|arithmetic|0", every_n_steps=100, output_dir="out"), backend)
for step in range(1, num_steps + 1):
    train_step()
    hook.maybe_evaluate(step, consumed_tokens=step * tokens_per_step)  # every rank calls it
hook.close()
```

Every rank calls the hook at the same steps (`should_run` depends on the step only); every rank gets the same
`HookResults`; global rank 0 (or `publish_rank`) writes `<output_dir>/eval_results.jsonl` (one fsynced line per
evaluation), `<output_dir>/step_<N>/results.json` (atomic), and logs to W&B / TensorBoard.

The JSONL file is appended to, so a training job resumed from a checkpoint continues its log. The first row a hook
writes drops the rows of the file at or past its step first (one atomic rewrite): they belong to a run this one
replaces (a fresh run from step 1 starts a fresh file, a run resumed at step S forgets the old run's steps >= S), so
rerunning a training script never duplicates rows. A failed evaluation (fail_soft) leaves a
`{"step", "failed"}` row in the JSONL file and `eval/failed = 1` in W&B.

Training is not changed by an evaluation: the model is scored in eval mode under no_grad and every module's
train/eval flag is restored; every RNG state (python, numpy, torch CPU, CUDA) is saved before the hook does
anything (scoring, W&B, file writes) and restored after; gradients and optimizer state are never touched.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist

from nano_eval.backends.base import Backend, evaluation_mode, scoring_session
from nano_eval.engine import BatchingConfig
from nano_eval.errors import BadDocumentError, EvaluationFailed, NanoEvalError, describe_failures
from nano_eval.evaluator import EvalConfig, EvalResults, Evaluator, TaskResult
from nano_eval.parallel import any_rank_true
from nano_eval.tracking.files import check_output_paths, write_jsonl
from nano_eval.tracking.jsonl import append_jsonl, read_jsonl
from nano_eval.tracking.results import results_document, write_results
from nano_eval.tracking.wandb_logger import TensorBoardLogger, WandbLogger, metric_key, one_line
from nano_eval.training.config import EvalHookConfig, sample_caps
from nano_eval.local_files import printable, single_line

logger = logging.getLogger(__name__)

JSONL_NAME = "eval_results.jsonl"


@dataclass
class HookResults(EvalResults):
    """EvalResults of one in-training evaluation, plus when it ran and which tasks the time budget skipped."""

    step: int = 0
    consumed_tokens: int | None = None
    skipped_tasks: list[str] = field(default_factory=list)  # in the order they would have run
    time_s: float = 0.0


class EvalHookError(RuntimeError):
    """An evaluation failed on at least one rank and fail_soft=False: raised on every rank together."""


class EvalHook:
    """Evaluate the live model from inside any training loop. Build on every rank; call on every rank.

    Failure agreement: a fault on one rank outside the model's forwards (data, prompts, detokenising, stop
    sequences, metrics) ends the evaluation on every rank at the next point where the ranks meet, within one batch
    or decoding step (nano_eval.agreement), never at the process group's timeout; whatever else happens inside a
    call (rank 0's file writes included), each rank ends it with one all-reduce of a failure flag over the world
    group (plus a gather of the error messages when a rank failed). So all ranks take the same branch with every
    collective matched: with fail_soft=True every rank reports and returns None and training continues on process
    groups still in step; with fail_soft=False every rank raises `EvalHookError` naming the step, the failing ranks
    and the first one's error.

    Limitation: a fault inside a forward (one rank running out of memory halfway through a tensor-parallel or
    expert-parallel collective, a kernel failing on one rank) leaves the other ranks inside that collective until
    the process group's timeout (`init_process_group(timeout=...)`): no evaluator can recover from that. Faults that
    happen on every rank (bad task data, an OOM on every rank) end the evaluation alike. W&B and TensorBoard failures
    never fail an evaluation.
    Only `Exception`s are caught: KeyboardInterrupt and SystemExit go straight through on the rank that got them.
    Every rank must call the hook at the same steps (`should_run` depends only on the step, so
    `maybe_evaluate(step)` from every rank is enough).
    """

    def __init__(self, config: EvalHookConfig, backend: Backend, *, tasks: list | None = None):
        """Load and tokenise the tasks once (`tasks`: prebuilt [(TaskSpec, Task)] instead of `config.tasks`).

        Collective: every rank must build the hook. If building fails on any rank, it raises on every rank."""
        start = time.perf_counter()
        self.config, self.backend, self.layout = config, backend, backend.layout
        if config.publish_rank >= self.layout.world_size:
            raise ValueError(f"publish_rank={config.publish_rank} but the job has {self.layout.world_size} ranks")
        self.is_publisher = self.layout.rank == config.publish_rank
        self.output_dir = Path(config.output_dir)
        self.failed_steps: list[int] = []
        self.bad_tasks: dict[str, str] = {}
        self.evaluated_steps: list[int] = []
        self._printed_traceback = False
        self._log_started = False  # the first JSONL row drops an earlier run's rows at or past its step
        self._next_task = 0  # where the next evaluation starts (time-budget rotation)
        self._last_step: int | None = None
        self._eval_seconds = 0.0
        self._closed = False
        self.wandb: WandbLogger | None = None
        self.tensorboard: TensorBoardLogger | None = None
        with evaluation_mode(None):  # neither task building nor W&B start-up may move the trainer's RNG streams
            error = None
            try:
                self.specs, self._evaluators = self._build(tasks)
            except Exception as e:  # noqa: BLE001 -- agreed on below, then raised on every rank
                error = e
            failures = self._agree(error)
            if failures:
                if error is not None:
                    raise error
                raise EvalHookError(f"building the evaluation hook failed on {describe_failures(failures)}")
            if self.is_publisher:
                self.wandb = WandbLogger(
                    enabled=config.wandb,
                    project=config.wandb_project,
                    entity=config.wandb_entity,
                    name=config.wandb_run_name,
                    mode=config.wandb_mode,
                    dir=str(config.wandb_dir or config.output_dir),
                    step_key=config.step_key,
                    log_step=config.wandb_log_step,
                    tokens_key=config.tokens_key,
                    prefix=config.metric_prefix,
                    init_kwargs=config.wandb_init_kwargs,
                    run_config={"nano_eval": _jsonable(asdict(config))},
                )
                if config.tensorboard_dir:
                    self.tensorboard = TensorBoardLogger(str(config.tensorboard_dir))
        self.build_seconds = time.perf_counter() - start
        self._built_at = time.perf_counter()

    @classmethod
    def for_transformers(cls, config: EvalHookConfig, model, tokenizer, *, max_length: int | None = None, **kwargs):
        """A hook for a transformers causal LM (plain, or wrapped in DistributedDataParallel: every rank is a
        data-parallel replica; scoring uses the wrapped module, so DDP's gradient hooks never fire)."""
        from torch.nn.parallel import DistributedDataParallel

        from nano_eval.backends.transformers import TransformersModel

        inner = model.module if isinstance(model, DistributedDataParallel) else model
        return cls(config, TransformersModel(inner, tokenizer, max_length=max_length), **kwargs)

    def _build(self, tasks):
        """(specs, one Evaluator per task). With fail_soft, a task whose documents cannot be scored (bad gold index,
        no choices, empty continuation) is left out with one warning and the other tasks run; `self.bad_tasks`
        keeps {task: why}."""
        from nano_eval.tasks import load_tasks

        c = self.config
        if self.layout.rank == c.publish_rank:  # a bad entry in the output folder: a clear error now, not at step N
            check_output_paths(c.output_dir, files=[JSONL_NAME], option="output_dir")
        bad: dict[str, str] | None = {} if c.fail_soft else None
        if tasks is None:
            tasks = load_tasks(c.tasks, custom_tasks=c.custom_tasks, data_dir=c.data_dir, bad_documents=bad,
                               lm_eval_include_path=c.lm_eval_include_path)
        caps = sample_caps([spec for spec, _ in tasks], c.max_samples, c.max_samples_per_task)
        batching = BatchingConfig(max_batch_tokens=c.batch_tokens, max_batch_size=c.max_batch_size)
        specs, evaluators = [], []
        for (spec, task), cap in zip(tasks, caps):  # one Evaluator per task, so a time budget can stop between tasks
            try:
                evaluators.append(Evaluator(self.backend, [(spec, task)],
                                            EvalConfig(max_samples=cap, seed=c.seed, add_bos_token=c.add_bos_token,
                                                       use_chat_template=c.use_chat_template,
                                                       system_prompt=c.system_prompt,
                                                       lm_eval_bootstrap_iters=c.lm_eval_bootstrap_iters,
                                                       batching=batching, progress=c.progress)))
                specs.append(spec)
            except BadDocumentError as e:  # few-shot documents are checked when the prompts are built
                if bad is None:
                    raise
                bad[task.name] = str(e)
        self.bad_tasks = bad or {}
        for name, why in self.bad_tasks.items():
            if self.layout.rank == c.publish_rank:
                print(f"nano_eval: warning: task {name} is skipped by the evaluation hook (fail_soft=True): "
                      f"{printable(why)}",
                      file=sys.stderr, flush=True)
        if not evaluators:
            raise NanoEvalError(f"no task of {c.tasks!r} can be evaluated: every one has unscorable documents "
                                "(see the warnings above)")
        return specs, evaluators

    # ---- schedule ------------------------------------------------------------------------------------------------

    @property
    def last_step(self) -> int | None:
        """The step of the latest call (evaluated or failed); None before the first."""
        return self._last_step

    def should_run(self, step: int) -> bool:
        """True at every_n_steps multiples (step > 0) and at also_at_steps, once per step."""
        if step == self._last_step:
            return False
        n = self.config.every_n_steps
        return step in self.config.also_at_steps or (n is not None and step > 0 and step % n == 0)

    def maybe_evaluate(self, step: int, consumed_tokens: int | None = None) -> HookResults | None:
        """Evaluate if `should_run(step)`; the one call a training loop needs."""
        return self(step, consumed_tokens) if self.should_run(step) else None

    # ---- one evaluation ------------------------------------------------------------------------------------------

    def __call__(self, step: int, consumed_tokens: int | None = None) -> HookResults | None:
        """Evaluate now, on every rank. Returns the results (the same on every rank), or None if the evaluation
        failed and fail_soft=True. Raises EvalHookError on every rank if it failed and fail_soft=False."""
        if self._closed:
            raise RuntimeError("EvalHook.__call__ after close()")
        start = time.perf_counter()
        self._last_step = step
        results = None
        try:
            with evaluation_mode(None):  # RNG of everything below is restored on the way out
                error = None
                try:
                    with scoring_session(self.backend):  # e.g. FSDP2 parameters gathered once for all tasks
                        results = self._evaluate(step, consumed_tokens)
                except Exception as e:  # noqa: BLE001
                    error = e
                # EvaluationFailed: raised on every rank together (nano_eval.agreement), so already agreed on
                failures = error.failures if isinstance(error, EvaluationFailed) else self._agree(error)
                if not failures:  # rank 0 publishes; the others wait for its verdict
                    results.time_s = time.perf_counter() - start
                    try:
                        if self.is_publisher:
                            self._publish(results, start)
                    except Exception as e:  # noqa: BLE001
                        error = e
                    failures = self._agree(error)
                if failures:
                    self._report(step, consumed_tokens, error, failures)
                    return None
                self.evaluated_steps.append(step)
                return results
        finally:
            self._eval_seconds += time.perf_counter() - start

    def _evaluate(self, step: int, consumed_tokens: int | None) -> HookResults:
        n = len(self._evaluators)
        order = [(self._next_task + i) % n for i in range(n)]
        budget = self.config.time_budget_s
        start = time.perf_counter()
        scored: dict[str, TaskResult] = {}
        timings: dict[str, float] = {}
        work: dict[str, Counter] = {}
        skipped: list[str] = []
        failed: dict[str, str] = {}
        self._next_task = 0
        for position, index in enumerate(order):
            if position > 0 and budget is not None:
                over = time.perf_counter() - start >= budget
                if any_rank_true(over, None, self.layout.world_size, self.layout.device):  # one verdict for all
                    skipped = [self.specs[i].key for i in order[position:]]
                    self._next_task = index
                    break
            result = self._evaluators[index].evaluate(step)
            scored.update(result.tasks)
            failed.update(result.failed)
            for key in result.non_finite:  # the Evaluator leaves these to its caller: one line, training goes on
                if self.is_publisher:
                    print(f"nano_eval: warning: step {step}: {single_line(result.failed[key])}", file=sys.stderr,
                          flush=True)
            for key, value in result.timings.items():
                if key not in ("build_s", "evaluate_s"):
                    timings[key] = timings.get(key, 0.0) + value
            for rtype, counts in result.work.items():
                work.setdefault(rtype, Counter()).update(counts)
        timings.update(build_s=self.build_seconds, evaluate_s=time.perf_counter() - start)
        ordered = {s.key: scored[s.key] for s in self.specs if s.key in scored}
        ordered.update((k, v) for k, v in scored.items() if k not in ordered)  # an lm-eval group's members
        return HookResults(tasks=ordered, timings=timings, failed=failed, step=step, consumed_tokens=consumed_tokens,
                           work={rtype: dict(counts) for rtype, counts in work.items()},
                           skipped_tasks=skipped)

    def _publish(self, results: HookResults, start: float) -> None:
        """Rank 0: per-step files, then the JSONL line (its presence means the step's files are complete), then
        W&B / TensorBoard (best effort)."""
        step = results.step
        time_share = (self._eval_seconds + time.perf_counter() - start) / max(time.perf_counter() - self._built_at,
                                                                             1e-9)
        write_results(self.output_dir / f"step_{step}", self._document(results), results,
                      details=self.config.write_details, root=self.output_dir)
        self._append_row({
            "step": step,
            "consumed_tokens": results.consumed_tokens,
            "time_s": results.time_s,
            "time_share": time_share,
            "results": {k: tr.metrics for k, tr in results.tasks.items()},
            "skipped_tasks": results.skipped_tasks,
            **({"failed_tasks": results.failed} if results.failed else {}),
        })
        flat = self.flat_metrics(results)
        flat[f"{self.config.metric_prefix}/time_s"] = results.time_s
        flat[f"{self.config.metric_prefix}/time_share"] = time_share
        flat[f"{self.config.metric_prefix}/skipped_tasks"] = len(results.skipped_tasks)
        flat[f"{self.config.metric_prefix}/failed"] = 0  # 1 on the steps whose evaluation failed (see _record_failure)
        flat[f"{self.config.metric_prefix}/failed_tasks"] = len(results.failed)
        if self.wandb is not None:
            self.wandb.log(flat, step=step, consumed_tokens=results.consumed_tokens)
        if self.tensorboard is not None:
            if results.consumed_tokens is not None:
                flat[self.config.tokens_key] = results.consumed_tokens
            self.tensorboard.log(flat, step=step)

    def _append_row(self, row: dict) -> None:
        """Publisher: append one row to eval_results.jsonl; the hook's first row drops the file's rows at or past
        its step first (an earlier run's, that this run replaces)."""
        path = self.output_dir / JSONL_NAME
        if not self._log_started:
            self._log_started = True
            if os.path.lexists(path):  # read as local_files does: a FIFO or symlink there is refused, never followed
                kept = [r for r in read_jsonl(path, root=self.output_dir)
                        if isinstance(r.get("step"), int) and r["step"] < row["step"]]
                write_jsonl(path, kept, root=self.output_dir)
        append_jsonl(path, row, root=self.output_dir)

    def flat_metrics(self, results: EvalResults) -> dict[str, float]:
        """`{"eval/<task key>/<metric>": value}` as logged to W&B and TensorBoard."""
        out = {}
        for key, tr in results.tasks.items():
            for name, value in tr.metrics.items():
                # nano_eval's "acc_stderr", lm-eval's "acc_stderr,none"
                if name.partition(",")[0].endswith("_stderr") and not self.config.log_stderr:
                    continue
                out[metric_key(self.config.metric_prefix, key, name)] = value
        return out

    def _document(self, results: HookResults) -> dict:
        c = self.config
        config = {"tasks": c.tasks, "max_samples": c.max_samples,
                  "max_samples_per_task": dict(c.max_samples_per_task or {}), "seed": c.seed,
                  "add_bos_token": c.add_bos_token, "use_chat_template": c.use_chat_template,
                  "system_prompt": c.system_prompt, "batch_tokens": c.batch_tokens, "max_batch_size": c.max_batch_size,
                  "time_budget_s": c.time_budget_s}
        return results_document(results, layout=self.layout, config=config, step=results.step,
                                consumed_tokens=results.consumed_tokens,
                                extra={"skipped_tasks": results.skipped_tasks})

    # ---- failures ------------------------------------------------------------------------------------------------

    def _agree(self, error: BaseException | None) -> list[tuple[int, str]]:
        """Collective over the world group: every rank learns which ranks failed, and why.

        One int all-reduce when nothing failed; plus one all_gather_object of the messages when something did."""
        local = None if error is None else one_line(error, limit=1000)
        world = self.layout.world_size
        if world == 1:
            return [] if local is None else [(self.layout.rank, local)]
        if not any_rank_true(local is not None, None, world, self.layout.device):
            return []
        parts: list[str | None] = [None] * world
        dist.all_gather_object(parts, local)
        return [(rank, message) for rank, message in enumerate(parts) if message is not None]

    def _report(self, step: int, consumed_tokens: int | None, error: BaseException | None,
                failures: list[tuple[int, str]]) -> None:
        self.failed_steps.append(step)
        if isinstance(error, EvaluationFailed):  # every rank has it; the failing ranks have their own error under it
            error = error.__cause__
        if error is not None:  # the failing rank: full traceback once, later ones at debug level
            tb = "".join(traceback.format_exception(error))
            if not self._printed_traceback:
                self._printed_traceback = True
                print(f"nano_eval: [rank {self.layout.rank}] evaluation at step {step} raised:\n{tb}",
                      file=sys.stderr, flush=True)
            else:
                logger.debug("evaluation at step %s raised:\n%s", step, tb)
        message = f"evaluation at step {step} failed on {describe_failures(failures)}"
        if not self.config.fail_soft:
            raise EvalHookError(message) from error
        if self.is_publisher:
            print(f"nano_eval: warning: {message}; training continues (fail_soft=True)", file=sys.stderr, flush=True)
            self._record_failure(step, consumed_tokens, message)

    def _record_failure(self, step: int, consumed_tokens: int | None, message: str) -> None:
        """Publisher, fail_soft: the failed step leaves a trace where the results would have gone: a JSONL row
        `{"step", "consumed_tokens", "failed": why}` and `eval/failed = 1` in W&B / TensorBoard. Never raises (a
        full disk must not stop training either)."""
        try:
            self._append_row({"step": step, "consumed_tokens": consumed_tokens, "failed": message})
        except Exception as e:  # noqa: BLE001
            print(f"nano_eval: warning: could not record the failure in {self.output_dir / JSONL_NAME}: "
                  f"{one_line(e)}", file=sys.stderr, flush=True)
        flat = {f"{self.config.metric_prefix}/failed": 1}
        if self.wandb is not None:
            self.wandb.log(flat, step=step, consumed_tokens=consumed_tokens)
        if self.tensorboard is not None:
            self.tensorboard.log(flat, step=step)

    # ---- end -----------------------------------------------------------------------------------------------------

    @property
    def time_share(self) -> float:
        """Share of wall time since the hook was built that was spent inside hook calls."""
        return self._eval_seconds / max(time.perf_counter() - self._built_at, 1e-9)

    def close(self) -> None:
        """Finish the W&B run if the hook opened it; close TensorBoard. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with evaluation_mode(None):
            if self.wandb is not None:
                self.wandb.close()
            if self.tensorboard is not None:
                self.tensorboard.close()

    def __enter__(self) -> EvalHook:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
