"""Evaluator: build once (load data, build prompts, tokenise, sort), then `evaluate(step)` as often as you like.

`evaluate` only runs forwards, scores, and aggregates; every rank returns the same `EvalResults`.
"""

from __future__ import annotations

import math
import sys
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist

from nano_eval.agreement import message_of
from nano_eval.backends.base import Backend, evaluation_mode, scoring_session
from nano_eval.engine import WORK_COUNTS, BatchingConfig, Engine
from nano_eval.errors import NonFiniteScoreError, TaskCodeError
from nano_eval.finite import check_finite
from nano_eval.generate import GenerationResult
from nano_eval.local_files import printable, single_line
from nano_eval.parallel import any_rank_true, sum_over_dp
from nano_eval.response import ModelResponse
from nano_eval.tasks import Task, TaskSpec, build_requests
from nano_eval.tasks.task import TaskResult
from nano_eval.tasks.requests import Doc, Request, RequestType
from nano_eval.tokenization import chat_renderer


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What to evaluate and how; scores never depend on `batching`."""

    max_samples: int | None = None  # first K documents of each task (dataset order)
    seed: int = 0  # few-shot sampling seed
    # BOS before every context: None = the tokenizer's own choice (lm-evaluation-harness's default), True / False
    # force it (see nano_eval.tokenization). Changes scores.
    add_bos_token: bool | None = None
    # Contexts as a conversation rendered by the tokenizer's chat template (instruct models); off for base models.
    use_chat_template: bool = False
    system_prompt: str | None = None  # first thing in every context (the system turn with a chat template)
    # Bootstrap resamples for the stderrs of lm_eval|... metrics that lm-eval bootstraps (mcc, f1, perplexity,
    # median; bleu/chrf/ter at most 100, as lm-eval): None = lm-eval's default (100000), 0 = no stderrs (lm-eval's
    # bootstrap_iters=0). Changes stderrs only, never the metrics themselves.
    lm_eval_bootstrap_iters: int | None = None
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    progress: bool = True


@dataclass
class EvalResults:
    tasks: dict[str, TaskResult]
    timings: dict[str, float]
    failed: dict[str, str] = field(default_factory=dict)  # task key -> why it failed while being scored
    # those of `failed` that are bad input, for the caller to report in one line: NaN / inf scores (nano_eval.finite),
    # task code that would have ended the process (errors.TaskCodeError)
    non_finite: list[str] = field(default_factory=list)
    # scoring work per request type, summed over data-parallel ranks (results.json's "positions"): forwards, token
    # positions given to the model (rows x columns), the padding among them, positions through the output layer
    work: dict[str, dict[str, int]] = field(default_factory=dict)

    def table(self) -> str:
        """A plain-text results table, one row per task and metric."""
        rows = [("task", "version", "metric", "value", "stderr", "docs")]
        for key, tr in self.tasks.items():
            for name, value in tr.metrics.items():
                if name.endswith("_stderr") or "_stderr," in name:
                    continue
                metric, comma, filtered = name.partition(",")
                err = tr.metrics.get(f"{metric}_stderr{comma}{filtered}", math.nan)
                rows.append((printable(key), printable(str(tr.version)), printable(name), f"{value:.4f}", f"{err:.4f}",
                             str(tr.num_docs)))  # names from task files, printed escaped
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


ONE_LINE_FAILURES = (NonFiniteScoreError, TaskCodeError)  # a task's failures that are bad input, not a bug


@dataclass
class _PreparedTask:
    spec: TaskSpec
    task: Task  # or an external task (`external = True`: builds its own requests and scores its own results)
    docs: list[Doc]  # an external task's own build record
    requests: list[Request]


class Evaluator:
    """Scores a backend's model on tasks. Construction does all the one-time work."""

    def __init__(self, backend: Backend, tasks: list[tuple[TaskSpec, Task]], config: EvalConfig = EvalConfig()):
        start = time.perf_counter()
        self.backend, self.config = backend, config
        self.engine = Engine(backend, config.batching, progress=config.progress, add_bos_token=config.add_bos_token)
        self.prepared: list[_PreparedTask] = []
        by_type: dict[RequestType, list[Request]] = defaultdict(list)
        chat = chat_renderer(backend.tokenizer) if config.use_chat_template else None
        for spec, task in tasks:
            if getattr(task, "external", False):  # another harness's task (nano_eval.tasks.lm_eval_tasks)
                docs, requests = task.build_requests(spec.num_fewshot, max_samples=config.max_samples,
                                                     system_prompt=config.system_prompt, chat=chat,
                                                     bootstrap_iters=config.lm_eval_bootstrap_iters)
            else:
                docs, requests = build_requests(task, spec.num_fewshot, seed=config.seed,
                                                max_samples=config.max_samples, system_prompt=config.system_prompt,
                                                chat=chat)
            self.prepared.append(_PreparedTask(spec, task, docs, requests))
            for r in requests:
                by_type[r.request_type].append(r)
        self.datasets = {t: self._prepare(t, reqs) for t, reqs in by_type.items()}
        self.build_seconds = time.perf_counter() - start

    def _prepare(self, rtype: RequestType, requests: list[Request]):
        match rtype:
            case RequestType.LOGLIKELIHOOD:
                return self.engine.prepare_loglikelihood(requests)
            case RequestType.LOGLIKELIHOOD_SINGLE_TOKEN:
                return self.engine.prepare_single_token(requests)
            case RequestType.LOGLIKELIHOOD_ROLLING:
                return self.engine.prepare_rolling(requests)
            case RequestType.GREEDY_UNTIL:
                return self.engine.prepare_greedy(requests)
        raise ValueError(f"request type {rtype.value} is not supported by nano_eval")

    def run_requests(self) -> tuple[dict, dict[str, float], dict[str, dict[str, int]]]:
        """Raw results of every request, keyed by request key, plus seconds spent per request type and the scoring
        work per request type (nano_eval.engine.count_work, summed over data-parallel ranks)."""
        results, timings, work = {}, {}, {}
        for rtype, dataset in self.datasets.items():
            start = time.perf_counter()
            if rtype == RequestType.GREEDY_UNTIL:
                results.update(self.engine.run_greedy(dataset))
            else:
                before = Counter(self.engine.work)
                results.update(self.engine.run_loglikelihood(dataset, desc=rtype.value))
                done = self.engine.work - before
                work[rtype.value] = sum_over_dp({k: done[k] for k in WORK_COUNTS}, self.backend.layout)
            timings[f"{rtype.value}_s"] = time.perf_counter() - start
        return results, timings, work

    def evaluate(self, step: int | None = None) -> EvalResults:
        """Every rank calls it; every rank returns the same results. A fault outside the forwards on any rank raises
        the same EvaluationFailed on every rank (nano_eval.agreement). A task whose scoring fails on any rank is
        listed in `failed` on every rank and the others are still scored: a metric's error is printed with its
        traceback; a task that got NaN / inf scores from the model or its metric code (nano_eval.finite, decided after
        the gather, so alike on every rank), or whose code would have ended the process (errors.TaskCodeError), is
        listed in `non_finite` too and left to the caller to report (one line, exit code 2)."""
        start = time.perf_counter()
        with evaluation_mode(getattr(self.backend, "module", None)), scoring_session(self.backend):
            raw, timings, work = self.run_requests()
        tasks, errors = {}, {}
        for p in self.prepared:  # one task's failure (a metric's bug) never loses the others' scores
            try:
                if getattr(p.task, "external", False):  # scored by its harness: {results key: TaskResult}
                    tasks.update(p.task.score(p.spec, p.docs, raw))
                else:
                    tasks[p.spec.key] = self._score_task(p, raw)
            except Exception as e:  # noqa: BLE001 -- reported, and listed in EvalResults.failed
                errors[p.spec.key] = e
        failed = self._failed_on_any_rank(errors)
        non_finite = [key for key, e in errors.items() if isinstance(e, ONE_LINE_FAILURES)]
        for key in failed:
            tasks.pop(key, None)
        if self.backend.layout.is_main:
            warn_truncation(tasks, self.backend.max_length)
        timings.update(build_s=self.build_seconds, evaluate_s=time.perf_counter() - start)
        return EvalResults(tasks=tasks, timings=timings, failed=failed, non_finite=non_finite, work=work)

    def _failed_on_any_rank(self, errors: dict[str, Exception]) -> dict[str, str]:
        """{task key: why} of the tasks whose scoring failed on any rank, the same on every rank (a metric can fail
        on one rank only: its own data, its own disk), so that every rank returns the same results. One int
        all-reduce over every rank, plus one all_gather_object when a task failed. The lowest rank a task failed on
        prints its traceback; rank 0 prints one error line per task."""
        lay = self.backend.layout
        mine = {key: message_of(e) for key, e in errors.items()}
        every = [mine]
        if lay.world_size > 1 and any_rank_true(bool(mine), None, lay.world_size, lay.device):
            every = [None] * lay.world_size
            dist.all_gather_object(every, mine)
        failed: dict[str, str] = {}
        for rank, part in enumerate(every):
            for key, why in (part or {}).items():
                if key in failed:
                    continue
                failed[key] = why if len(every) == 1 or all(key in p for p in every) else f"on rank {rank}: {why}"
                if isinstance(errors.get(key), ONE_LINE_FAILURES):
                    continue  # bad input, not a bug: one line, printed by the caller
                if key in errors and rank == lay.rank:
                    traceback.print_exception(errors[key])
                if lay.is_main:
                    print(f"nano_eval: error: task {printable(key)} failed while being scored: "
                          f"{single_line(failed[key])}",
                          file=sys.stderr, flush=True)
        return failed

    def _score_task(self, prepared: _PreparedTask, raw: dict) -> TaskResult:
        by_doc: dict[int, list[Request]] = defaultdict(list)
        for r in prepared.requests:
            by_doc[r.sample_index].append(r)
        metrics = prepared.task.metrics
        values: dict[str, list] = {m.name: [] for m in metrics}
        details, truncated = [], 0
        for i, doc in enumerate(prepared.docs):
            response = assemble_response(doc, by_doc[i], raw)
            first = by_doc[i][0]
            check_finite(prepared.spec.key, i, response, raw[first.key] if first.request_type ==
                         RequestType.GREEDY_UNTIL else None, first.request_type == RequestType.LOGLIKELIHOOD_ROLLING)
            truncated += response.truncated_tokens_count > 0
            sample = {m.name: m.compute(doc, response) for m in metrics}
            for name, v in sample.items():
                values[name].append(v)
            details.append(_detail_row(i, doc, by_doc[i], response, sample))
        scores: dict[str, float] = {}
        for m in metrics:
            scores[m.name] = m.aggregate(values[m.name])
            scores[f"{m.name}_stderr"] = m.stderr(values[m.name])
        return TaskResult(
            key=prepared.spec.key,
            version=prepared.task.version,
            metrics=scores,
            num_docs=len(prepared.docs),
            skipped_docs=prepared.task.num_skipped,
            truncated_requests=truncated,
            details=details,
        )


def warn_truncation(tasks: dict[str, TaskResult], max_length: int) -> None:
    """Prompts cut to fit the model change scores silently in other tools: say so, once per task."""
    for key, tr in tasks.items():
        if tr.truncated_requests:
            print(
                f"nano_eval: warning: task {key}: {tr.truncated_requests} of {tr.num_docs} documents had their context "
                f"cut on the left to fit the model's {max_length} tokens. Fix: fewer few-shot examples, or a longer "
                "--max-length if the model supports it.",
                file=sys.stderr,
            )


def assemble_response(doc: Doc, requests: list[Request], raw: dict) -> ModelResponse:
    """Fold the results of one document's requests into its ModelResponse (request index scheme: see Task)."""
    response = ModelResponse()
    first = requests[0]
    response.input = first.context
    response.input_tokens = list(getattr(first, "tokenized_context", None) or [])
    match first.request_type:
        case RequestType.LOGLIKELIHOOD:
            n = len(doc.choices)
            results = [raw[r.key] for r in sorted(requests, key=lambda r: r.request_index)]
            response.logprobs = [res.logprob for res in results[:n]]
            response.argmax_logits_eq_gold = [res.is_greedy for res in results[:n]]
            response.continuation_token_counts = [res.num_tokens for res in results[:n]]
            if len(results) > n:
                response.unconditioned_logprobs = [res.logprob for res in results[n:]]
            response.truncated_tokens_count = max(res.truncated for res in results)
        case RequestType.LOGLIKELIHOOD_SINGLE_TOKEN:
            results = raw[first.key]
            response.logprobs = [res.logprob for res in results]
            response.argmax_logits_eq_gold = [res.is_greedy for res in results]
            response.continuation_token_counts = [1] * len(results)
            response.truncated_tokens_count = results[0].truncated
        case RequestType.LOGLIKELIHOOD_ROLLING:
            windows = [v for (k, _), v in _windows_of(first.key, raw)]
            response.logprobs = [sum(w.logprob for w in windows)]
            response.continuation_token_counts = [sum(w.num_tokens for w in windows)]
        case RequestType.GREEDY_UNTIL:
            gen: GenerationResult = raw[first.key]
            samples = max(1, getattr(first, "num_samples", 1))  # greedy decoding: every sample is the same text
            response.text = [gen.text] * samples
            response.output_tokens = [gen.tokens] * samples
            response.input_tokens = gen.input_tokens
            response.truncated_tokens_count = gen.truncated
            response.post_process()
    return response


def _windows_of(key: tuple, raw: dict) -> list:
    windows, w = [], 0
    while (key, w) in raw:
        windows.append(((key, w), raw[(key, w)]))
        w += 1
    return windows


def _detail_row(index: int, doc: Doc, requests: list[Request], response: ModelResponse, sample: dict) -> dict:
    row = {
        "doc_index": index,
        "context": requests[0].context,
        "choices": doc.choices,
        "gold_index": doc.gold_index,
        "logprobs": response.logprobs,
        "argmax_logits_eq_gold": response.argmax_logits_eq_gold,
        "truncated_tokens": response.truncated_tokens_count,
        "metrics": {k: (list(v) if isinstance(v, tuple) else v) for k, v in sample.items()},
    }
    if response.text:
        row["predictions"] = response.final_text
    return row
