"""`Task`: a `TaskConfig` bound to its data; turns documents into the requests a backend answers.

Request index scheme (the evaluator matches answers back by `(task_name, sample_index, request_index)`):
- LOGLIKELIHOOD: request i scores choice i after the context; when a metric needs PMI, request n + i (n choices)
  scores choice i after `doc.unconditioned_query` (or "Answer:" when the prompt function left it None).
- LOGLIKELIHOOD_SINGLE_TOKEN: request 0 scores all choices after the context.
- LOGLIKELIHOOD_ROLLING: request 0 scores `doc.query` alone (few-shot never applies to perplexity).
- GREEDY_UNTIL: request 0 generates from the context.
A request type needed by several metrics is requested once; `metric_categories` names the metrics it serves.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections import defaultdict
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

from tqdm import tqdm

from nano_eval.errors import BadDocumentError, NanoEvalError, UnsupportedTaskError
from nano_eval.tasks.config import TaskConfig
from nano_eval.tasks.loading import load_split
from nano_eval.tasks.prompt import PromptManager, doc_identity
from nano_eval.tasks.requests import (
    Doc,
    GreedyUntilRequest,
    LoglikelihoodRequest,
    LoglikelihoodRollingRequest,
    LoglikelihoodSingleTokenRequest,
    Request,
    RequestType,
)

DEFAULT_UNCONDITIONED_QUERY = "Answer:"  # lighteval's PMI default when a prompt function sets none
FEWSHOT_SPLIT_PREFERENCE = ("train", "validation", "test")


def resolve_metric(metric):
    """Names go through the metrics registry; objects are used as they are (custom metrics need no registration)."""
    if not isinstance(metric, str):
        return metric
    from nano_eval.metrics import get_metric  # lazy: tasks import without the metrics package

    return get_metric(metric)


@dataclass
class TaskResult:
    """One task's scores, as the evaluator (or another harness's task: nano_eval.tasks.lm_eval_tasks) returns them."""

    key: str  # "suite|task|k"
    version: int | float | str | None  # lm-eval tasks carry lm-eval's version
    # metric -> value, plus "<metric>_stderr"; lm-eval tasks: lm-eval's keys, "<metric>,<filter>" and
    # "<metric>_stderr,<filter>"
    metrics: dict[str, float]
    num_docs: int
    skipped_docs: int
    truncated_requests: int
    details: list[dict]


class Task:
    """One task's data, prompts and requests. `name` is the full name "suite|task"."""

    def __init__(self, config: TaskConfig, data_dir: str | os.PathLike | None = None, suite: str | None = None):
        self.config = config
        self.data_dir = data_dir
        self.name = f"{suite or config.suite[0]}|{config.name}"
        self.version = config.version
        self.skipped: dict[str, int] = {}  # split -> rows the prompt function returned None for
        self._docs: dict[tuple[str, bool], list[Doc]] = {}  # (split, as few-shot examples) -> docs
        self._metrics = None

    def __repr__(self) -> str:
        return f"Task({self.name!r})"

    def refuse_if_unsupported(self) -> None:
        """Stop here, naming the task and each reason, when its config uses what nano_eval cannot run."""
        reasons = self.config.unsupported
        if reasons:
            raise UnsupportedTaskError(
                f"task {self.name!r} cannot run in nano_eval: {'; '.join(reasons)}. Fix: leave this task out of "
                "--tasks (the other tasks of its file run), or replace what is named with a supported equivalent "
                "(README: \"Port a lighteval task file\").", task=self.name)

    @property
    def metrics(self) -> list:
        self.refuse_if_unsupported()
        if self._metrics is None:
            try:
                self._metrics = [resolve_metric(m) for m in self.config.metrics]
            except ValueError as e:
                raise NanoEvalError(f"task {self.name!r}: {e}") from e
        return self._metrics

    def aggregation(self) -> dict:
        return {m.name: m for m in self.metrics}

    def split_docs(self, split: str, few_shots: bool = False) -> list[Doc]:
        """The docs of one split, cached; rows the prompt function maps to None are skipped and counted.

        As lighteval does, the prompt function sees each row with two extra keys: `__few_shots` (True when the doc
        will serve as a few-shot example: lighteval's PIQA prompt then gives the solution texts as choices) and
        `__index` (the row's position in the split); a doc without an `id` gets that position as its id.
        """
        if (split, few_shots) not in self._docs:
            docs, skipped = [], 0
            for i, row in enumerate(load_split(self.config, split, self.data_dir)):
                doc = self._prompt({**row, "__few_shots": few_shots, "__index": i}, split, i)
                if doc is None or doc == []:
                    skipped += 1
                    continue
                if getattr(doc, "images", None):
                    raise NanoEvalError(f"task {self.name!r}: the prompt function returned a Doc with `images`; "
                                        "nano_eval scores text-only models: drop the images or the task")
                doc.id = doc.id or str(i)
                self._check(doc, split, i)
                docs.append(doc)
            if not few_shots:
                self.skipped[split] = skipped
            self._docs[(split, few_shots)] = docs
        return self._docs[(split, few_shots)]

    def _prompt(self, row: dict, split: str, index: int) -> Doc | None:
        try:
            return self.config.prompt_function(row, self.name)
        except Exception as e:
            shown = repr(row)
            shown = shown if len(shown) <= 200 else shown[:200] + "...}"
            raise NanoEvalError(
                f"task {self.name!r}: prompt function {getattr(self.config.prompt_function, '__name__', '?')} "
                f"failed on split {split!r} row {index}: {type(e).__name__}: {e}\n  row: {shown}\n"
                f"Fix the prompt function, or return None from it for rows that should be skipped."
            ) from e

    def _check(self, doc: Doc, split: str, index: int) -> None:
        """A document the task's requests cannot score stops the run here, before any forward, naming the row and
        the field (an out-of-range gold index would otherwise fail after all the scoring, naming nothing)."""
        problem = doc_problem(doc, {m.request_type for m in self.metrics})
        if problem is not None:
            raise BadDocumentError(
                f"task {self.name!r}: split {split!r} row {index}: {problem}. Fix: correct that row of the data or "
                "the prompt function (which may return None for rows that should not be scored).", task=self.name)

    def eval_docs(self) -> list[Doc]:
        """Docs of all evaluation splits in dataset order (deduplicated if the config asks for it)."""
        self.refuse_if_unsupported()
        docs = [d for split in self.config.evaluation_splits for d in self.split_docs(split)]
        if self.config.must_remove_duplicate_docs:
            seen: set = set()
            docs = [d for d in docs if not (doc_identity(d) in seen or seen.add(doc_identity(d)))]
        return docs

    @property
    def num_skipped(self) -> int:
        """Rows of the evaluation splits dropped by the prompt function (after `eval_docs()` ran)."""
        return sum(self.skipped.get(s, 0) for s in self.config.evaluation_splits)

    def get_first_possible_fewshot_splits(self, available_splits=None, number_of_splits: int = 1) -> list[str] | None:
        """The config's few_shots_split (one split or several, used in order), else the first of train > validation
        > test that the dataset has."""
        split = self.config.few_shots_split
        if split is not None:
            return list(split) if isinstance(split, tuple) else [split]
        available = self.config.hf_avail_splits if available_splits is None else available_splits
        splits = [s for s in FEWSHOT_SPLIT_PREFERENCE if s in available][:number_of_splits]
        return splits or None

    def fewshot_docs(self) -> list[Doc]:
        splits = self.get_first_possible_fewshot_splits()
        if splits is None:
            raise NanoEvalError(
                f"task {self.name!r}: few-shot examples were asked for but the task has no few-shot split "
                f"(hf_avail_splits={list(self.config.hf_avail_splits)}); set few_shots_split or use num_fewshot=0"
            )
        try:
            return [d for split in splits for d in self.split_docs(split, few_shots=True)]
        except NanoEvalError as e:
            raise NanoEvalError(
                f"{e}\n(Few-shot examples come from split(s) {splits}: set few_shots_split in the task config to "
                f"use another split, or use num_fewshot=0.)"
            ) from e

    @property
    def uses_fewshot(self) -> bool:
        """Perplexity (rolling loglikelihood) scores the bare document: few-shot examples would change the metric."""
        return any(m.request_type != RequestType.LOGLIKELIHOOD_ROLLING for m in self.metrics)

    def prompt_manager(self, num_fewshot: int) -> PromptManager:
        """Few-shot data is loaded only when shots are asked for: 0-shot runs need no train split."""
        pool = self.fewshot_docs() if num_fewshot > 0 and self.uses_fewshot else []
        return PromptManager(self.name, pool, self.config.few_shots_select)

    def _metrics_by_type(self) -> dict[RequestType, list]:
        by_type = defaultdict(list)
        for m in self.metrics:
            by_type[m.request_type].append(m)
        if len(by_type) > 1:  # their request indices would collide (all start at 0)
            raise NanoEvalError(
                f"task {self.name!r} mixes metrics of request types {[t.value for t in by_type]}; "
                f"nano_eval scores one request type per task: split it into one task per type"
            )
        return by_type

    def construct_requests(self, doc: Doc, context: str, sample_index: int) -> list[Request]:
        """All requests of one doc, indexed as described in the module docstring."""
        if self.config.generation_grammar is not None:
            raise NanoEvalError(
                f"task {self.name!r}: grammar-constrained generation (generation_grammar) is not supported by "
                f"nano_eval backends; remove generation_grammar from the task config"
            )
        name = doc.task_name or self.name
        requests: list[Request] = []
        for rtype, metrics in self._metrics_by_type().items():
            served = [m.name for m in metrics]
            if rtype == RequestType.LOGLIKELIHOOD:
                requests += self._loglikelihood_requests(doc, context, sample_index, name, metrics)
            elif rtype == RequestType.LOGLIKELIHOOD_SINGLE_TOKEN:
                requests.append(LoglikelihoodSingleTokenRequest(
                    name, sample_index, 0, context, served, choices=list(doc.choices)))
            elif rtype == RequestType.LOGLIKELIHOOD_ROLLING:
                requests.append(LoglikelihoodRollingRequest(name, sample_index, 0, doc.query, served))
            elif rtype == RequestType.GREEDY_UNTIL:
                requests.append(self._greedy_request(context, sample_index, name, metrics))
            else:
                raise NanoEvalError(
                    f"task {self.name!r}: request type {rtype.value!r} is not supported by nano_eval; "
                    f"drop the metrics {served} from the task"
                )
        return requests

    def _loglikelihood_requests(self, doc: Doc, context: str, sample_index: int, name: str, metrics) -> list:
        served = [m.name for m in metrics]
        requests = [
            LoglikelihoodRequest(name, sample_index, i, context, served, choice=choice)
            for i, choice in enumerate(doc.choices)
        ]
        pmi = [m.name for m in metrics if getattr(m, "needs_unconditioned", False)]
        if pmi:
            uncond = doc.unconditioned_query if doc.unconditioned_query is not None else DEFAULT_UNCONDITIONED_QUERY
            n = len(doc.choices)
            requests += [
                LoglikelihoodRequest(name, sample_index, n + i, uncond, pmi, choice=choice)
                for i, choice in enumerate(doc.choices)
            ]
        return requests

    def _greedy_request(self, context: str, sample_index: int, name: str, metrics) -> GreedyUntilRequest:
        num_samples = max([getattr(m, "num_samples", 1) for m in metrics] + [self.config.num_samples or 1])
        return GreedyUntilRequest(
            name, sample_index, 0, context, [m.name for m in metrics],
            stop_sequence=list(self.config.stop_sequence or []),
            generation_size=self.config.generation_size,
            num_samples=num_samples,
        )


CHOICE_TYPES = (RequestType.LOGLIKELIHOOD, RequestType.LOGLIKELIHOOD_SINGLE_TOKEN, RequestType.GREEDY_UNTIL)


def doc_problem(doc: Doc, request_types: set) -> str | None:
    """What makes `doc` unscorable by requests of `request_types` ("field ...: why"), or None.

    Choice tasks (loglikelihood, single token) score every choice as a continuation: choices must be a non-empty list
    of non-empty strings. Generative tasks compare against the gold choices. Both need gold indices in range.
    Rolling-loglikelihood tasks score `query`, which must be a non-empty string."""
    if RequestType.LOGLIKELIHOOD_ROLLING in request_types:
        if not isinstance(doc.query, str) or not doc.query:
            return f"field 'query' is {doc.query!r}: perplexity tasks need a non-empty text"
    if not request_types & set(CHOICE_TYPES):
        return None
    choices = doc.choices
    if not isinstance(choices, (list, tuple)) or not choices:
        return f"field 'choices' is {choices!r}: this task needs at least one choice"
    if request_types & {RequestType.LOGLIKELIHOOD, RequestType.LOGLIKELIHOOD_SINGLE_TOKEN}:
        for i, c in enumerate(choices):
            if not isinstance(c, str) or not c:
                return f"field 'choices' item {i} is {c!r}: every choice is scored as a continuation and must be " \
                       "a non-empty string"
    golds = doc.gold_index if isinstance(doc.gold_index, (list, tuple)) else [doc.gold_index]
    if not golds:
        return "field 'gold_index' is empty: name at least one correct choice"
    for g in golds:
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or not 0 <= g < len(choices):
            return f"field 'gold_index' holds {g!r}, not an index into the {len(choices)} choices"
    return None


def build_requests(task: Task, num_fewshot: int, seed: int = 0, max_samples: int | None = None, *,
                   system_prompt: str | None = None, chat=None):
    """The first `max_samples` eval docs (dataset order) and all their requests; deterministic for every layout.

    `system_prompt` and `chat` (messages -> text, the tokenizer's chat template) shape each context as described in
    nano_eval.tasks.prompt; perplexity documents are scored as they are, without either.

    Docs are copied with `task_name` set to the results key "suite|task|k", so the same task at two shot counts
    gives distinct request keys. Perplexity-only tasks ignore `num_fewshot` (and load no few-shot data).
    """
    if num_fewshot < 0:
        raise NanoEvalError(f"task {task.name!r}: num_fewshot={num_fewshot} is negative; use 0 or more")
    docs = task.eval_docs()
    docs = docs if max_samples is None else docs[:max_samples]
    shots = num_fewshot if task.uses_fewshot else 0
    prompts = task.prompt_manager(shots)
    key = f"{task.name}|{num_fewshot}"
    out_docs, requests = [], []
    for i, doc in enumerate(docs):
        context = (prompts.make_context(doc, i, shots, seed, system_prompt, chat) if task.uses_fewshot
                   else prompts.make_context(doc, i, 0, seed))
        doc = dataclasses.replace(doc, task_name=key)
        out_docs.append(doc)
        requests += task.construct_requests(doc, context, i)
    return out_docs, requests


def _load_task(task: Task) -> list:
    try:
        return task.eval_docs()
    except BadDocumentError:
        raise
    except NanoEvalError as e:
        if str(e).startswith("task "):
            raise
        raise NanoEvalError(f"task {task.name!r}: {e}") from e  # a data file's error names the task too
    except Exception as e:
        raise NanoEvalError(f"task {task.name!r}: loading its data failed: {type(e).__name__}: {e}") from e


def load_datasets(tasks: Iterable[Task] | dict[str, Task], processes: int = 1,
                  bad_documents: dict[str, str] | None = None) -> dict[str, list]:
    """Load every task's evaluation docs, `processes` tasks at a time in threads; returns {task name: docs}.

    bad_documents: None raises the first BadDocumentError; a dict collects {task name: message} instead and leaves
    those tasks out of the result (the training hook skips them). Threads suffice: the work is file IO and Arrow
    decoding, which release the GIL.
    """
    tasks = list(tasks.values()) if isinstance(tasks, dict) else list(tasks)

    def load(task: Task):
        try:
            return _load_task(task)
        except BadDocumentError as e:
            if bad_documents is None:
                raise
            return e

    if processes <= 1 or len(tasks) <= 1:
        loaded = [(task, load(task)) for task in tasks]
    else:
        # datasets' loaders run tqdm's thread_map, whose lock set-up races when no tqdm lock exists yet: one thread
        # deletes the lock another is about to delete (AttributeError '_lock', seen under torchrun;
        # huggingface/datasets#7660). With the class-wide lock created first, thread_map only borrows it.
        tqdm.get_lock()
        with ThreadPoolExecutor(max_workers=processes, thread_name_prefix="nano_eval-load") as pool:
            futures = [(task, pool.submit(load, task)) for task in tasks]
            loaded = [(task, future.result()) for task, future in futures]
    out = {}
    for task, docs in loaded:
        if isinstance(docs, BadDocumentError):
            bad_documents[task.name] = str(docs)
        else:
            out[task.name] = docs
    return out
