"""Run lighteval custom task files as they are written: change their `lighteval` imports to this module.

    from nano_eval.tasks.lighteval import LightevalTaskConfig, Doc, Metrics, LogProbCharNorm, helm_normalizer

Everything a task file imports from `lighteval.tasks.lighteval_task`, `lighteval.tasks.requests`,
`lighteval.metrics.metrics`, `lighteval.metrics.normalizations`, `lighteval.metrics.utils.metric_utils`,
`lighteval.models.model_output`, and the eight prompt functions of `lighteval.tasks.tasks.*` that lighteval's nanotron
example imports (nano_eval.tasks.lighteval_prompts), is here under the same name (see `__all__`).
`LightevalTaskConfig` takes lighteval's arguments in lighteval's order with its defaults and builds a nano_eval
`TaskConfig`:

- `metrics`: `Metrics` members (parametrised or not), lighteval metric records (grouped ones become one metric per
  name) or nano_eval metric names; two metrics with one name are an error naming both.
- `metric` (lighteval < 0.8's name of `metrics`, still in its nanotron example) is read as `metrics`.
- `generation_size=-1` means the model's default (None); `num_samples` (a list in lighteval) becomes its maximum.
- `few_shots_select`: "random_sampling" and "random_sampling_from_train" are nano_eval's "random" (a fresh sample per
  document, never the document itself); None, "random", "balanced", "sequential" keep nano_eval's meaning. The
  examples picked are nano_eval's deterministic choice, not lighteval's.
- inspect-ai fields (`solver`, `scorer`, `sample_fields`, `sample_to_fewshot`, `filter`) and `num_fewshots` (the spec
  gives the shots) are accepted and ignored, with one warning per field and process.
- What nano_eval cannot do fails at once with the field named: `hf_data_files`, `output_regex`, a metric with
  `batched_compute`, `Metrics` members it lacks (the error lists the ones it has); `generation_grammar` (constrained
  decoding; `TextGenerationInputGrammarType` is importable so such files load) fails when the task's requests are
  built.
- Files written for lighteval >= 0.11 also import inspect-ai (`Sample`, `choice`, `multiple_choice`, ...) for the
  `solver`/`scorer`/`sample_fields` fields: keep those imports with inspect-ai installed (the fields are ignored) or
  delete the imports and the fields.

Prompt functions may take `(line, task_name)` or, as in older lighteval files, `(line)`, and return a `Doc`, a dict
of `Doc` fields (older lighteval) or None. As in lighteval, prompt functions see `line["__few_shots"]` (True for
few-shot examples) and `line["__index"]`.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable

from nano_eval.metrics.lighteval import (AccGoldLikelihood, CorpusLevelMetric, CorpusLevelMetricGrouping, ExactMatches,
                                         F1_score, LoglikelihoodAcc, MajAtN, Metric, MetricGrouping, Metrics, PassAtK,
                                         SampleLevelComputation, SampleLevelMetric, SampleLevelMetricGrouping,
                                         to_nano_metrics)
from nano_eval.metrics.normalizations import (LogProbCharNorm, LogProbPMINorm, LogProbTokenNorm, bigbench_normalizer,
                                              gsm8k_normalizer, harness_triviaqa_normalizer, helm_normalizer,
                                              math_normalizer, remove_braces, remove_braces_and_strip)
from nano_eval.response import ModelResponse
from nano_eval.tasks.config import TaskConfig, TaskConfigError
from nano_eval.tasks.lighteval_prompts import (arc_prompt, gsm8k_prompt, math_prompt, openbookqa_prompt, piqa_prompt,
                                               quac_prompt, triviaqa_prompt, winogrande_prompt)
from nano_eval.tasks.requests import Doc, SamplingMethod

try:  # lighteval re-exports huggingface_hub's type; transformers depends on huggingface_hub
    from huggingface_hub import TextGenerationInputGrammarType
except ImportError:  # pragma: no cover - an old huggingface_hub
    TextGenerationInputGrammarType = dict  # type: ignore[misc,assignment]

IGNORED_FIELDS = ("solver", "scorer", "sample_fields", "sample_to_fewshot", "filter", "num_fewshots", "frozen")
FEW_SHOT_MODES = {"random_sampling": "random", "random_sampling_from_train": "random"}
_warned: set[str] = set()


def _warn_ignored(task: str, field: str) -> None:
    if field in _warned:
        return
    _warned.add(field)
    if os.environ.get("RANK", "0") == "0":
        print(f"nano_eval: warning: task {task!r}: lighteval field `{field}` is accepted and ignored (nano_eval has no "
              "use for it); said once per field", file=sys.stderr)


def as_list(item) -> list:
    """lighteval's helper: a list or tuple as a list, anything else as a one-item list."""
    return list(item) if isinstance(item, (list, tuple)) else [item]


def math_scorer():
    """lighteval's inspect-ai scorer, for its `scorer` field, which nano_eval ignores: returns None."""
    return None


def multichoice_scorer():
    """lighteval's inspect-ai scorer, for its `scorer` field, which nano_eval ignores: returns None."""
    return None


class _LightevalPrompt:
    """A lighteval prompt function as nano_eval calls it: `(line, task_name) -> Doc | None`.

    Older lighteval files (its nanotron example) define `prompt(line)` and return a dict of `Doc` fields; both work.
    """

    def __init__(self, fn: Callable, task: str):
        self.fn, self.task, self.__name__ = fn, task, getattr(fn, "__name__", "prompt_function")
        try:
            params = inspect.signature(fn).parameters.values()
            positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            self.takes_task = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)
        except (TypeError, ValueError):  # a builtin or C callable: lighteval's two-argument form
            self.takes_task = True

    def __call__(self, line: dict, task_name: str):
        doc = self.fn(line, task_name) if self.takes_task else self.fn(line)
        if isinstance(doc, dict):
            unknown = sorted(set(doc) - set(Doc.__dataclass_fields__))
            if unknown:
                raise TypeError(f"the returned dict has key(s) {unknown} that are not Doc fields")
            doc = Doc(**{"task_name": task_name, **doc})
        return doc


class LightevalTaskConfig(TaskConfig):
    """lighteval's `LightevalTaskConfig(name, prompt_function, hf_repo, hf_subset, metrics, ...)`, as a TaskConfig."""

    def __init__(self, name: str, prompt_function: Callable[[dict, str], Doc | None], hf_repo: str,
                 hf_subset: str | None = "default", metrics: Any = (), hf_data_files: Any = None,
                 hf_revision: str | None = None, hf_filter: Callable[[dict], bool] | None = None,
                 hf_avail_splits=("train", "validation", "test"), evaluation_splits=("validation",),
                 few_shots_split: str | None = None, few_shots_select: str | None = None,
                 generation_size: int | None = None, generation_grammar: Any = None, stop_sequence=None,
                 num_samples: list[int] | int | None = None, original_num_docs: int = -1, effective_num_docs: int = -1,
                 must_remove_duplicate_docs: bool = False, version: int = 0, suite=("custom",),
                 trust_dataset: bool = False, output_regex: str | None = None, **ignored):
        def fail(field: str, problem: str, fix: str):
            raise TaskConfigError(f"task {name!r}: lighteval field `{field}`: {problem}; {fix}")

        if "metric" in ignored:  # lighteval < 0.8 called the field `metric` (its nanotron example still does)
            if metrics:
                fail("metric", "given together with `metrics`", "keep one of the two")
            metrics = ignored.pop("metric")
        unknown = sorted(set(ignored) - set(IGNORED_FIELDS))
        if unknown:
            fail(unknown[0], "unknown field", f"remove it (known lighteval fields: see {__name__}.LightevalTaskConfig)")
        for field in ignored:
            _warn_ignored(name, field)
        if hf_data_files is not None:
            fail("hf_data_files", "not supported", "set hf_repo to the local data file or folder instead")
        if output_regex is not None:
            fail("output_regex", "not supported", "post-process predictions inside a custom metric instead")
        object.__setattr__(self, "num_fewshots", ignored.get("num_fewshots", 0))
        super().__init__(
            name=name, prompt_function=_LightevalPrompt(prompt_function, name), hf_repo=hf_repo, hf_subset=hf_subset,
            metrics=_metrics(name, metrics), hf_revision=hf_revision, hf_filter=hf_filter,
            hf_avail_splits=hf_avail_splits, evaluation_splits=evaluation_splits, few_shots_split=few_shots_split,
            few_shots_select=FEW_SHOT_MODES.get(few_shots_select, few_shots_select),
            generation_size=None if generation_size == -1 else generation_size,
            generation_grammar=generation_grammar, stop_sequence=stop_sequence,
            num_samples=max(as_list(num_samples)) if num_samples else None,
            original_num_docs=original_num_docs, effective_num_docs=effective_num_docs,
            must_remove_duplicate_docs=must_remove_duplicate_docs, version=version, suite=suite,
            trust_dataset=trust_dataset,
        )

    @property
    def full_name(self) -> str:
        return f"{self.name}|{self.num_fewshots}"


def _metrics(task: str, metrics) -> tuple:
    """lighteval metrics -> nano_eval metrics (names pass through); duplicated result names are an error."""
    out = []
    for m in as_list(metrics):
        try:
            out += to_nano_metrics(m)
        except (TypeError, ValueError) as e:
            raise TaskConfigError(f"task {task!r}: lighteval field `metrics`: {e}") from e
    names = [m if isinstance(m, str) else m.name for m in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TaskConfigError(
            f"task {task!r}: lighteval field `metrics`: several metrics are named {twice} (e.g. loglikelihood_acc_norm "
            "and loglikelihood_acc_norm_nospace are both 'acc_norm'); keep one, or parametrise one so its name differs")
    return tuple(out)


__all__ = [
    "AccGoldLikelihood", "CorpusLevelMetric", "CorpusLevelMetricGrouping", "Doc", "ExactMatches", "F1_score",
    "LightevalTaskConfig", "LogProbCharNorm", "LogProbPMINorm", "LogProbTokenNorm", "LoglikelihoodAcc", "MajAtN",
    "Metric", "MetricGrouping", "Metrics", "ModelResponse", "PassAtK", "SampleLevelComputation", "SampleLevelMetric",
    "SampleLevelMetricGrouping", "SamplingMethod", "TextGenerationInputGrammarType", "as_list", "bigbench_normalizer",
    "gsm8k_normalizer", "harness_triviaqa_normalizer", "helm_normalizer", "math_normalizer", "math_scorer",
    "multichoice_scorer", "remove_braces", "remove_braces_and_strip",
    # lighteval.tasks.tasks.<name>.<name>_prompt
    "arc_prompt", "gsm8k_prompt", "math_prompt", "openbookqa_prompt", "piqa_prompt", "quac_prompt", "triviaqa_prompt",
    "winogrande_prompt",
]
