"""`TaskConfig`: everything needed to turn a dataset into scored documents (lighteval's `LightevalTaskConfig` fields).

Field names and defaults follow lighteval so existing custom task files port by changing one import. Sequence fields
given as lists are stored as tuples: a config is a frozen value that can be shared between threads and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from nano_eval.errors import NanoEvalError
from nano_eval.tasks.requests import Doc

FEW_SHOTS_SELECT = (None, "balanced", "sequential", "random")
_TUPLE_FIELDS = ("metrics", "hf_avail_splits", "evaluation_splits", "stop_sequence", "suite")
_SPLIT = "a split name or a list of split names"


class TaskConfigError(NanoEvalError, ValueError):
    """A task config is invalid; a ValueError too, so callers that validate input can catch it as one."""


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """One benchmark: where its rows live, how a row becomes a `Doc`, and which metrics score it.

    `hf_repo` is a Hub id, a local data file, or a local folder (see `nano_eval.tasks.loading`).
    `few_shots_select=None` means "random". `generation_grammar` is accepted for compatibility but rejected when
    requests are built: no nano_eval backend can constrain decoding.
    """

    name: str
    prompt_function: Callable[[dict, str], Doc | None]
    hf_repo: str
    hf_subset: str | None = "default"
    metrics: tuple[Any, ...]  # metric names or Metric objects
    hf_revision: str | None = None
    hf_filter: Callable[[dict], bool] | None = None
    hf_avail_splits: tuple[str, ...] = ("train", "validation", "test")
    evaluation_splits: tuple[str, ...] = ("validation",)
    few_shots_split: str | tuple[str, ...] | None = None  # several splits (a list) are used in order
    few_shots_select: str | None = None
    generation_size: int | None = None
    generation_grammar: Any = None
    stop_sequence: tuple[str, ...] | None = None
    num_samples: int | None = None
    suite: tuple[str, ...] = ("custom",)
    original_num_docs: int = -1
    effective_num_docs: int = -1
    must_remove_duplicate_docs: bool = False
    trust_dataset: bool = False  # accepted for lighteval compatibility; datasets>=4 runs no loading scripts
    version: int = 0
    # Why the task cannot run in nano_eval (e.g. "metric `bleurt`: needs a model download"): the task still lists,
    # and stops with these reasons when it is selected (nano_eval.tasks.lighteval fills it for lighteval files).
    unsupported: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in _TUPLE_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):  # a bare string is one item, not a sequence of characters
                value = (value,)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.few_shots_split, (list, tuple)):  # lighteval accepts ["dev"]: one or several splits
            object.__setattr__(self, "few_shots_split", tuple(self.few_shots_split))
        object.__setattr__(self, "unsupported", tuple(self.unsupported))
        self._validate()

    def _fail(self, problem: str, fix: str) -> None:
        raise TaskConfigError(f"task {self.name!r}: {problem}; {fix}")

    def _validate(self) -> None:
        if not isinstance(self.name, str) or not self.name or "|" in self.name:
            self._fail("`name` must be a non-empty string without '|'", "rename the task, e.g. 'mmlu:anatomy'")
        if not callable(self.prompt_function):
            self._fail("`prompt_function` is not callable", "pass a function (line: dict, task_name: str) -> Doc")
        if not isinstance(self.hf_repo, str) or not self.hf_repo:
            self._fail("`hf_repo` is empty", "give a Hub dataset id, a data file or a data folder")
        if self.hf_filter is not None and not callable(self.hf_filter):
            self._fail("`hf_filter` is not callable", "pass a function (row: dict) -> bool or None")
        if not self.metrics and not self.unsupported:
            self._fail("`metrics` is empty", "list at least one metric, e.g. metrics=['acc']")
        if not self.evaluation_splits:
            self._fail("`evaluation_splits` is empty", "name the split(s) to score, e.g. ['validation']")
        if not self.suite:
            self._fail("`suite` is empty", "name a suite, e.g. suite=['custom']")
        splits = self.few_shots_split if isinstance(self.few_shots_split, tuple) else (self.few_shots_split,)
        if self.few_shots_split is not None and (not splits or not all(isinstance(x, str) and x for x in splits)):
            self._fail(f"few_shots_split={self.few_shots_split!r}", f"use None, {_SPLIT}")
        if self.few_shots_select not in FEW_SHOTS_SELECT:
            self._fail(f"unknown few_shots_select {self.few_shots_select!r}", f"use one of {FEW_SHOTS_SELECT}")
        if self.generation_size is not None and (not isinstance(self.generation_size, int) or self.generation_size < 1):
            self._fail(f"generation_size={self.generation_size!r}", "use a positive int or None (model default)")
        if self.num_samples is not None and (not isinstance(self.num_samples, int) or self.num_samples < 1):
            self._fail(f"num_samples={self.num_samples!r}", "use a positive int or None")
        if self.stop_sequence is not None and not all(isinstance(s, str) for s in self.stop_sequence):
            self._fail("`stop_sequence` holds non-strings", "pass a list of strings")
