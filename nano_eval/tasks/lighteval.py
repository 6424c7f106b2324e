"""Run lighteval custom task files as they are written: change their `lighteval` imports to this module.

    from nano_eval.tasks.lighteval import LightevalTaskConfig, Doc, Metrics, LogProbCharNorm, helm_normalizer

Everything task files import from `lighteval.*` that can run offline is here under the same name (see `__all__`):
the task config, `Doc` and `ModelResponse`; the metric records and the whole `Metrics` catalogue
(nano_eval.metrics.lighteval, library-backed scores in nano_eval.metrics.lighteval_scores); normalisers; the
templates, formulations and `Language` of the multilingual files (nano_eval.tasks.lighteval_templates,
nano_eval.tasks.languages); lighteval's prompt functions that files import from `lighteval.tasks.tasks.*`
(nano_eval.tasks.lighteval_prompts); and its small helpers (`as_list`, `LETTER_INDICES`, `requires`, ...).
`LightevalTaskConfig` takes lighteval's arguments in lighteval's order with its defaults and builds a nano_eval
`TaskConfig`:

- `metrics`: `Metrics` members (parametrised or not), lighteval metric records (grouped ones become one metric per
  name) or nano_eval metric names.
- `metric` (lighteval < 0.8's name of `metrics`, still in its nanotron example) is read as `metrics`.
- `generation_size=-1` means the model's default (None); `num_samples` (a list in lighteval) becomes its maximum.
- `few_shots_select`: "random_sampling" and "random_sampling_from_train" are nano_eval's "random" (a fresh sample per
  document, never the document itself); None, "random", "balanced", "sequential" keep nano_eval's meaning. The
  examples picked are nano_eval's deterministic choice, not lighteval's.
- inspect-ai fields (`solver`, `scorer`, `sample_fields`, `sample_to_fewshot`, `filter`) and `num_fewshots` (the spec
  gives the shots) are accepted and ignored, with one warning per field and process.
- What nano_eval cannot run never stops the file: a metric it cannot compute (`UnsupportedMetric` members, LLM
  judges, `batched_compute`), two metrics with one result name, `hf_data_files`, `output_regex`, `generation_grammar`,
  a template for a language without prompt words: each is recorded in the config's `unsupported`, the task lists,
  and it stops with those reasons (UnsupportedTaskError) only when it is selected. A misspelt field or a `Metrics`
  member lighteval does not have either is an error at once.
- Files written for lighteval >= 0.11 also import inspect-ai (`Sample`, `choice`, `multiple_choice`, ...) for the
  `solver`/`scorer`/`sample_fields` fields: keep those imports with inspect-ai installed (the fields are ignored) or
  delete the imports and the fields.

Prompt functions may take `(line, task_name)` or, as in older lighteval files, `(line)`, and return a `Doc`, a dict
of `Doc` fields (older lighteval) or None. As in lighteval, prompt functions see `line["__few_shots"]` (True for
few-shot examples) and `line["__index"]`.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import string
import sys
from typing import Any, Callable

from nano_eval.errors import NanoEvalError
from nano_eval.metrics.lighteval import (BLEU, MRR, ROUGE, AccGoldLikelihood, AvgAtN, CorpusLevelComputation,
                                         CorpusLevelF1Score, CorpusLevelMetric, CorpusLevelMetricGrouping,
                                         CorpusLevelPerplexityMetric, CorpusLevelTranslationMetric, ExactMatches,
                                         ExprExtractionConfig, F1_score, GenerativePreparator,
                                         IndicesExtractionConfig, JudgeLLM, JudgeLM, LatexExtractionConfig,
                                         LoglikelihoodAcc, LogLikelihoodAccMetric, LoglikelihoodPreparator, MajAtN,
                                         MatthewsCorrCoef, Metric, MetricGrouping, MetricRefused, Metrics,
                                         MultilingualExtractiveMatchMetric, MultilingualQuasiExactMatchMetric,
                                         MultilingualQuasiF1ScoreMetric, NormalizedMultiChoiceProbability,
                                         NormalizedMultiChoiceProbMetric, PassAtK, PerplexityPreparator, Preparator,
                                         Probability, ProbabilityMetric, Recall, SampleLevelComputation,
                                         SampleLevelMetric, SampleLevelMetricGrouping, StringDistance,
                                         TargetPerplexityPreparator, TruthfulqaMCMetrics, UnsupportedMetric,
                                         to_nano_metrics)
from nano_eval.metrics.lighteval_scores import as_list
from nano_eval.metrics.normalizations import (LogProbCharNorm, LogProbPMINorm, LogProbTokenNorm, bigbench_normalizer,
                                              get_multilingual_normalizer, gsm8k_normalizer,
                                              harness_triviaqa_normalizer, helm_normalizer, math_normalizer,
                                              remove_articles, remove_braces, remove_braces_and_strip, remove_punc)
from nano_eval.response import ModelResponse
from nano_eval.tasks.config import TaskConfig, TaskConfigError
from nano_eval.tasks.suite.catalog import MMLU_SUBJECTS
from nano_eval.tasks.languages import Language, iso_639_3_ind_to_iso_639_3_macro, manage_duplicate_language_codes
from nano_eval.tasks.lighteval_prompts import (arc_prompt, gsm8k_prompt, hellaswag_prompt, math_prompt, mmlu_prompt,
                                               openbookqa_prompt, piqa_prompt, quac_prompt, triviaqa_prompt,
                                               truthful_qa_multiple_choice_prompt, winogrande_prompt)
from nano_eval.tasks.lighteval_templates import (TRANSLATION_LITERALS, CFFormulation, Formulation, HybridFormulation,
                                                 MCFFormulation, TranslationLiterals, UnsupportedPrompt,
                                                 get_boolq_prompt_function, get_continuation_prompt_function,
                                                 get_copa_prompt_function, get_hellaswag_prompt_function,
                                                 get_mcq_prompt_function, get_nli_prompt_function,
                                                 get_qa_prompt_function, get_translation_prompt_function)
from nano_eval.tasks.requests import Doc, SamplingMethod

try:  # lighteval re-exports huggingface_hub's type; transformers depends on huggingface_hub
    from huggingface_hub import TextGenerationInputGrammarType
except ImportError:  # pragma: no cover - an old huggingface_hub
    TextGenerationInputGrammarType = dict  # type: ignore[misc,assignment]

IGNORED_FIELDS = ("solver", "scorer", "sample_fields", "sample_to_fewshot", "filter", "num_fewshots", "frozen")
FEW_SHOT_MODES = {"random_sampling": "random", "random_sampling_from_train": "random"}
LETTER_INDICES = list(string.ascii_uppercase)  # lighteval.tasks.default_prompts.LETTER_INDICES
MMLU_SUBSETS = list(MMLU_SUBJECTS)  # lighteval.tasks.multilingual.tasks.MMLU_SUBSETS: the 57 MMLU subjects
_warned: set[str] = set()


def _warn_ignored(task: str, field: str) -> None:
    if field in _warned:
        return
    _warned.add(field)
    if os.environ.get("RANK", "0") == "0":
        print(f"nano_eval: warning: task {task!r}: lighteval field `{field}` is accepted and ignored (nano_eval has no "
              "use for it); said once per field", file=sys.stderr)


def is_package_available(package) -> bool:
    """lighteval's check: can `package` (a name; lighteval's `Extra` members are not known here) be imported?"""
    name = getattr(package, "name", package)
    return isinstance(name, str) and importlib.util.find_spec(name.replace("-", "_")) is not None


def requires(*packages):
    """lighteval's decorator: the function or class works as written; calling it without `packages` installed
    stops naming them."""

    def wrap(obj):
        missing = [p for p in packages if not is_package_available(p)]
        if not missing:
            return obj

        @functools.wraps(obj)
        def refuse(*args, **kwargs):
            raise NanoEvalError(f"{getattr(obj, '__name__', obj)} needs the package(s) {missing}. Fix: pip install "
                                f"{' '.join(map(str, missing))} torch==2.13.0")

        return refuse

    return wrap


def normalize_subset(subset: str) -> str:
    """A subset name as lighteval spells it in task names: spaces to "_", no parentheses, lower case."""
    return subset.replace(" ", "_").replace("(", "").replace(")", "").lower()


def get_metrics_for_formulation(formulation: Formulation, metrics: list) -> list:
    """Letter-choice multiple choice (MCF with Letters) is scored by plain accuracy only; else `metrics`."""
    if isinstance(formulation, MCFFormulation) and formulation.choice_prefix == "Letters":
        return [LogLikelihoodAccMetric(normalization=None)]
    return metrics


def math_scorer():
    """lighteval's inspect-ai scorer, for its `scorer` field, which nano_eval ignores: returns None."""
    return None


def multichoice_scorer():
    """lighteval's inspect-ai scorer, for its `scorer` field, which nano_eval ignores: returns None."""
    return None


def get_extraction_regexes_inspect(*args, **kwargs) -> None:
    """For lighteval's inspect-ai scorers, which nano_eval never calls (files build them at import): None."""
    return None


def extract_target_from_pred(*args, **kwargs) -> list:
    """For lighteval's inspect-ai scorers, which nano_eval never calls: nothing extracted."""
    return []
ifeval_metrics = UnsupportedMetric(["prompt_level_strict_acc", "inst_level_strict_acc", "prompt_level_loose_acc",
                                    "inst_level_loose_acc"], "IFEval's instruction checkers are not ported")


class UnsupportedAdapter:
    """One of lighteval's data-set adapters (lighteval.tasks.multilingual.adapters) that nano_eval has not ported:
    a template given it returns an UnsupportedPrompt, so the task refuses to run and the file still loads."""

    def __init__(self, name: str):
        self.__name__ = name
        self.unsupported_reason = f"adapter {name} (lighteval.tasks.multilingual.adapters) is not ported"

    def __call__(self, *args, **kwargs):
        if args and isinstance(args[0], dict):  # used as an adapter: refuse
            raise NanoEvalError(self.unsupported_reason)
        return self  # a factory (get_m3exam_adapter(language, ...)): the adapter it would build


(alghafa_adapter, ceval_adapter, enem_adapter, get_m3exam_adapter, get_mkqa_adapter, thai_exams_adapter,
 winogrand_adapter, xcodah_adapter) = map(UnsupportedAdapter, [
    "alghafa_adapter", "ceval_adapter", "enem_adapter", "get_m3exam_adapter", "get_mkqa_adapter",
    "thai_exams_adapter", "winogrand_adapter", "xcodah_adapter"])


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
        metrics, unsupported = _metrics(name, metrics)
        if not metrics and not unsupported:  # inspect-ai tasks may score only through their `scorer`
            unsupported.append("it names no metrics (lighteval >= 0.11 tasks may score only through an inspect-ai "
                               "`scorer`, which nano_eval does not run)")
        if hf_data_files is not None:
            unsupported.append("lighteval field `hf_data_files` is not supported (set hf_repo to the local data "
                               "file or folder instead)")
        if output_regex is not None:
            unsupported.append("lighteval field `output_regex` is not supported (post-process predictions inside a "
                               "custom metric instead)")
        if generation_grammar is not None:
            unsupported.append("lighteval field `generation_grammar` (grammar-constrained decoding) is not supported "
                               "by nano_eval backends")
        if getattr(prompt_function, "unsupported_reason", None):
            unsupported.append(f"prompt function: {prompt_function.unsupported_reason}")
        object.__setattr__(self, "num_fewshots", ignored.get("num_fewshots", 0))
        super().__init__(
            name=name, prompt_function=_LightevalPrompt(prompt_function, name), hf_repo=hf_repo, hf_subset=hf_subset,
            metrics=metrics, hf_revision=hf_revision, hf_filter=hf_filter,
            hf_avail_splits=hf_avail_splits, evaluation_splits=evaluation_splits, few_shots_split=few_shots_split,
            few_shots_select=FEW_SHOT_MODES.get(few_shots_select, few_shots_select),
            generation_size=None if generation_size == -1 else generation_size,
            generation_grammar=None, stop_sequence=stop_sequence,
            num_samples=max(as_list(num_samples)) if num_samples else None,
            original_num_docs=original_num_docs, effective_num_docs=effective_num_docs,
            must_remove_duplicate_docs=must_remove_duplicate_docs, version=version, suite=suite,
            trust_dataset=trust_dataset, unsupported=unsupported,
        )

    @property
    def full_name(self) -> str:
        return f"{self.name}|{self.num_fewshots}"


def _metrics(task: str, metrics) -> tuple[tuple, list[str]]:
    """lighteval metrics -> (nano_eval metrics, why the task cannot run): a metric nano_eval cannot compute, or two
    metrics with one result name, is a reason, so only this task refuses when selected; a non-metric is an error."""
    out, unsupported = [], []
    for m in as_list(metrics):
        try:
            out += to_nano_metrics(m)
        except MetricRefused as e:
            unsupported.append(str(e))
        except (TypeError, ValueError) as e:
            raise TaskConfigError(f"task {task!r}: lighteval field `metrics`: {e}") from e
    names = [m if isinstance(m, str) else m.name for m in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        unsupported.append(
            f"several of its metrics are named {twice} (e.g. loglikelihood_acc_norm and loglikelihood_acc_norm_nospace "
            "are both 'acc_norm'); nano_eval reports one value per name: keep one, or parametrise one so its name "
            "differs")
    return tuple(out), unsupported


__all__ = [
    # lighteval.tasks.lighteval_task, lighteval.tasks.requests, lighteval.models.model_output
    "Doc", "LightevalTaskConfig", "ModelResponse", "SamplingMethod", "TextGenerationInputGrammarType",
    # lighteval.metrics.metrics, .metrics_sample, .metrics_corpus, .sample_preparator, .utils.metric_utils,
    # .harness_compatibility, .dynamic_metrics, .utils.extractive_match_utils, .utils.llm_as_judge
    "AccGoldLikelihood", "AvgAtN", "BLEU", "CorpusLevelComputation", "CorpusLevelF1Score", "CorpusLevelMetric",
    "CorpusLevelMetricGrouping", "CorpusLevelPerplexityMetric", "CorpusLevelTranslationMetric", "ExactMatches",
    "ExprExtractionConfig", "F1_score", "GenerativePreparator", "IndicesExtractionConfig", "JudgeLLM", "JudgeLM",
    "LatexExtractionConfig", "LogLikelihoodAccMetric", "LoglikelihoodAcc", "LoglikelihoodPreparator", "MRR",
    "MajAtN", "MatthewsCorrCoef", "Metric", "MetricGrouping", "Metrics", "MultilingualExtractiveMatchMetric",
    "MultilingualQuasiExactMatchMetric", "MultilingualQuasiF1ScoreMetric", "NormalizedMultiChoiceProbMetric",
    "NormalizedMultiChoiceProbability", "PassAtK", "PerplexityPreparator", "Preparator", "Probability",
    "ProbabilityMetric", "ROUGE", "Recall", "SampleLevelComputation", "SampleLevelMetric", "SampleLevelMetricGrouping",
    "StringDistance", "TargetPerplexityPreparator", "TruthfulqaMCMetrics", "UnsupportedMetric",
    "extract_target_from_pred", "get_extraction_regexes_inspect", "ifeval_metrics", "math_scorer",
    "multichoice_scorer",
    # lighteval.metrics.normalizations
    "LogProbCharNorm", "LogProbPMINorm", "LogProbTokenNorm", "bigbench_normalizer", "get_multilingual_normalizer",
    "gsm8k_normalizer", "harness_triviaqa_normalizer", "helm_normalizer", "math_normalizer", "remove_articles",
    "remove_braces", "remove_braces_and_strip", "remove_punc",
    # lighteval.tasks.templates.*, lighteval.tasks.multilingual.*
    "CFFormulation", "Formulation", "HybridFormulation", "MCFFormulation", "TRANSLATION_LITERALS",
    "TranslationLiterals", "UnsupportedPrompt", "get_boolq_prompt_function", "get_continuation_prompt_function",
    "get_copa_prompt_function", "get_hellaswag_prompt_function", "get_mcq_prompt_function", "get_metrics_for_formulation",
    "get_nli_prompt_function", "get_qa_prompt_function", "get_translation_prompt_function", "normalize_subset",
    "UnsupportedAdapter", "alghafa_adapter", "ceval_adapter", "enem_adapter", "get_m3exam_adapter", "get_mkqa_adapter",
    "thai_exams_adapter", "winogrand_adapter", "xcodah_adapter",
    # lighteval.utils.*, lighteval.tasks.default_prompts
    "LETTER_INDICES", "MMLU_SUBSETS", "Language", "as_list", "is_package_available", "iso_639_3_ind_to_iso_639_3_macro",
    "manage_duplicate_language_codes", "requires",
    # lighteval.tasks.tasks.<name>.<name>_prompt
    "arc_prompt", "gsm8k_prompt", "hellaswag_prompt", "math_prompt", "mmlu_prompt", "openbookqa_prompt", "piqa_prompt",
    "quac_prompt", "triviaqa_prompt", "truthful_qa_multiple_choice_prompt", "winogrande_prompt",
]
