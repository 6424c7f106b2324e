"""lighteval's metric API (`Metrics`, `SampleLevelMetric`, `SampleLevelMetricGrouping`, ...) over nano_eval metrics.

A lighteval metric is a record: `metric_name`, `category` (a `SamplingMethod`), `sample_level_fn` (an object with
`compute(doc=, model_response=)` or a function of `(doc, model_response)`), `corpus_level_fn` and
`higher_is_better`; grouped metrics give lists/dicts of those, one per name, and their sample function returns
`{name: value}`. `Metrics.<member>(sample_params={...})` returns a copy whose sample function has those attributes
set and whose name is `"<name>:k=v&..."`, as in lighteval (functions appear by `__name__`, not by address).
`to_nano_metrics` turns any of them into nano_eval `Metric`s (one per name); nano_eval metric names and `Metric`
objects pass through unchanged. Written for nano_eval after lighteval's documented API; no lighteval code is used.
"""

from __future__ import annotations

import copy
import enum
import inspect
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from nano_eval.metrics.metric import Metric as NanoMetric
from nano_eval.metrics.metric import mean
from nano_eval.metrics.normalizations import (LogProbCharNorm, LogProbPMINorm, gsm8k_normalizer, harness_triviaqa_normalizer,
                                              helm_normalizer, math_normalizer, normalize_log_probs)
from nano_eval.metrics.registry import METRICS
from nano_eval.response import ModelResponse
from nano_eval.tasks.requests import Doc, SamplingMethod

# --- sample-level computations (lighteval's classes, same constructor arguments) ---


class SampleLevelComputation:
    """Base of objects used as `sample_level_fn`: `compute(doc, model_response) -> float`."""

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        raise NotImplementedError


def _matches(gold: str, pred: str, kind: str) -> int:
    if kind == "prefix":
        return int(pred.startswith(gold))
    if kind == "suffix":
        return int(pred.endswith(gold))
    return int(pred == gold)


class ExactMatches(SampleLevelComputation):
    """Best (aggregation_function over every gold x prediction) string match after optional strip / normalisers."""

    def __init__(self, aggregation_function: Callable = max, normalize_gold: Callable | None = None,
                 normalize_pred: Callable | None = None, strip_strings: bool = False, type_exact_match: str = "full"):
        if type_exact_match not in ("prefix", "suffix", "full"):
            raise ValueError(f"type_exact_match={type_exact_match!r}; use 'prefix', 'suffix' or 'full'")
        self.aggregation_function, self.strip_strings = aggregation_function, strip_strings
        self.normalize_gold, self.normalize_pred = normalize_gold, normalize_pred
        self.type_exact_match = type_exact_match

    def compute_one_item(self, gold: str, pred: str) -> int:
        if not pred:
            return 0
        if self.strip_strings:
            gold, pred = gold.strip(), pred.strip()
        gold = self.normalize_gold(gold) if self.normalize_gold else gold
        pred = self.normalize_pred(pred) if self.normalize_pred else pred
        return _matches(gold, pred, self.type_exact_match)

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        return self.aggregation_function([self.compute_one_item(g, p) for g in doc.get_golds()
                                          for p in model_response.final_text])


class F1_score(SampleLevelComputation):  # noqa: N801 (lighteval's name)
    """Bag-of-words F1 (sets of whitespace-separated words) between gold and prediction, best over pairs."""

    def __init__(self, aggregation_function: Callable | None = max, normalize_gold: Callable | None = None,
                 normalize_pred: Callable | None = None, strip_strings: bool = False):
        self.aggregation_function = aggregation_function or max
        self.normalize_gold, self.normalize_pred, self.strip_strings = normalize_gold, normalize_pred, strip_strings

    def compute_one_item(self, gold: str, pred: str) -> float:
        gold = self.normalize_gold(gold) if self.normalize_gold else gold
        pred = self.normalize_pred(pred) if self.normalize_pred else pred
        gold_words, pred_words = set(gold.split()), set(pred.split())
        common = len(gold_words & pred_words)
        if not gold_words or not pred_words or not common:
            return 0.0
        precision, recall = common / len(pred_words), common / len(gold_words)
        return 2 * precision * recall / (precision + recall)

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        return self.aggregation_function([self.compute_one_item(g, p) for g in doc.get_golds()
                                          for p in model_response.final_text])


class LoglikelihoodAcc(SampleLevelComputation):
    """1 if the best (normalised) choice is a gold; ties go to the first choice (np.argmax)."""

    def __init__(self, logprob_normalization=None):
        self.logprob_normalization = logprob_normalization

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> int:
        n = len(doc.choices)
        scores = normalize_log_probs(self.logprob_normalization, model_response.logprobs[:n],
                                     model_response.unconditioned_logprobs, doc.choices,
                                     model_response.continuation_token_counts)
        return int(int(np.argmax(scores)) in doc.gold_indices())


class AccGoldLikelihood(SampleLevelComputation):
    """1 if greedy decoding after the context yields a gold choice exactly."""

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> int:
        return int(any(model_response.argmax_logits_eq_gold[g] for g in doc.gold_indices()))


class _SamplingMetric(SampleLevelComputation):
    """Shared by pass@k and maj@n: `normalize` / `strip_strings` on both sides, exact (or prefix/suffix) match."""

    def __init__(self, normalize: Callable | None = None, strip_strings: bool = False,
                 sample_scoring_function: str | None = None):
        self.normalize, self.strip_strings = normalize, strip_strings
        self.type_exact_match = sample_scoring_function or "full"
        if callable(sample_scoring_function):
            raise ValueError("sample_scoring_function as a function is not supported by nano_eval; "
                             "use 'full', 'prefix' or 'suffix'")

    def preprocess(self, text: str) -> str:
        text = text.strip() if self.strip_strings and text else text or ""
        return self.normalize(text) if self.normalize is not None else text

    def correct(self, doc: Doc, pred: str) -> int:
        return _matches(self.preprocess(doc.get_golds()[0]), self.preprocess(pred), self.type_exact_match)


class PassAtK(_SamplingMetric):
    """Unbiased pass@k over the first n predictions (n defaults to all of them)."""

    def __init__(self, k: int | None = None, n: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.k, self.n = k, n

    def num_samples(self) -> int:
        return max(self.k or 1, self.n or 1)

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        preds = model_response.final_text[: self.n or None]
        if self.k is None or len(preds) < self.k:
            raise ValueError(f"pass@k needs k set and at least k predictions (k={self.k}, got {len(preds)})")
        c = sum(self.correct(doc, p) for p in preds)
        return 1.0 - math.comb(len(preds) - c, self.k) / math.comb(len(preds), self.k)


class MajAtN(_SamplingMetric):
    """Is the most frequent of the first n (preprocessed) predictions the gold? (first seen wins ties)."""

    def __init__(self, n: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def num_samples(self) -> int:
        return self.n or 1

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> int:
        if self.n is None:
            raise ValueError("maj@n needs n: Metrics.maj_at_n(sample_params={'n': 4})")
        answers = [self.preprocess(p) for p in model_response.final_text[: self.n]]
        majority = Counter(answers).most_common(1)[0][0] if answers else ""
        return _matches(self.preprocess(doc.get_golds()[0]), majority, self.type_exact_match)


class _Native(SampleLevelComputation):
    """A nano_eval metric's per-document function used as a lighteval sample function (perplexities)."""

    def __init__(self, name: str):
        self.name = name

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs):
        return METRICS[self.name].sample_fn(doc, model_response)


# --- metric records ---


def _param_str(value: Any) -> str:
    return getattr(value, "__name__", None) or str(value)


@dataclass(eq=False)
class Metric:
    """lighteval's metric record; call it with `sample_params` for a renamed copy with those parameters set."""

    metric_name: str | list[str]
    higher_is_better: bool | dict[str, bool]
    category: SamplingMethod
    sample_level_fn: Any
    corpus_level_fn: Any
    batched_compute: bool = False

    def __call__(self, sample_params: dict | None = None):
        new = copy.deepcopy(self)
        params = sample_params or {}
        for key, value in params.items():
            setattr(new.sample_level_fn, key, value)
        suffix = "&".join(f"{k}={_param_str(v)}" for k, v in params.items())
        if suffix:
            names = [f"{n}:{suffix}" for n in _as_list(new.metric_name)]
            new.metric_name = names if isinstance(new.metric_name, list) else names[0]
        return new


class SampleLevelMetric(Metric):
    """A value per document, aggregated by `corpus_level_fn` (usually `np.mean`)."""


class CorpusLevelMetric(Metric):
    """A per-document value that only `corpus_level_fn` turns into a score."""


class SampleLevelMetricGrouping(Metric):
    """Several metrics from one sample function returning `{name: value}`."""


class CorpusLevelMetricGrouping(Metric):
    """Several corpus metrics from one sample function returning `{name: value}`."""


MetricGrouping = SampleLevelMetricGrouping


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


# --- the Metrics enum ---


def _em(**kw):
    return ExactMatches(**kw)


_GEN, _LOGPROBS, _PPL = SamplingMethod.GENERATIVE, SamplingMethod.LOGPROBS, SamplingMethod.PERPLEXITY


def _sample(name, fn, category=_GEN, corpus=np.mean, higher=True) -> SampleLevelMetric:
    return SampleLevelMetric(metric_name=name, sample_level_fn=fn, category=category, corpus_level_fn=corpus,
                             higher_is_better=higher)


def _native(nano_name: str, lighteval_name: str, category: SamplingMethod) -> CorpusLevelMetric:
    nano = METRICS[nano_name]
    return CorpusLevelMetric(metric_name=lighteval_name, sample_level_fn=_Native(nano_name), category=category,
                             corpus_level_fn=nano.corpus_fn, higher_is_better=nano.higher_is_better)


UNSUPPORTED_METRICS = {
    "bleu|bleu_1|bleu_4|chrf|chrf_plus|ter": "sacrebleu corpus scores",
    "rouge1|rouge2|rougeL|rougeLsum|rouge_t5|bert_score|bleurt|extractiveness|faithfulness|copyright": "extra scorers",
    "simpleqa_judge|gpqa_instruct_metric|gpqa_instruct_pass_at_k|expr_gold_metric|pass_at_k_math|pass_at_k_letters"
    "|avg_at_n_math|g_pass_at_k|g_pass_at_k_math|g_pass_at_k_latex|latex_gold_metric": "LLM judges / math-verify",
    "loglikelihood_f1|f1_score_macro|f1_score_micro|mcc|multi_f1_numeric|mrr|recall_at_k|drop|truthfulqa_mc_metrics"
    "|prediction_perplexity|avg_at_n": "not ported yet",
}


class _MetricsMeta(enum.EnumMeta):
    def __getattr__(cls, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        why = next((why for names, why in UNSUPPORTED_METRICS.items() if name in names.split("|")), None)
        reason = f"it needs {why}" if why else "lighteval has no such member either"
        raise AttributeError(
            f"Metrics.{name} is not available in nano_eval ({reason}); supported: "
            f"{', '.join(m.name for m in cls)}. Or define a SampleLevelMetric with your own sample_level_fn.")


class Metrics(enum.Enum, metaclass=_MetricsMeta):
    """lighteval's metrics by member name; `Metrics.x(sample_params={...})` parametrises a copy."""

    acc_golds_likelihood = _sample("acc", AccGoldLikelihood(), _LOGPROBS)
    loglikelihood_acc = _sample("acc", LoglikelihoodAcc(), _LOGPROBS)
    loglikelihood_acc_norm = _sample("acc_norm", LoglikelihoodAcc(LogProbCharNorm()), _LOGPROBS)
    loglikelihood_acc_norm_nospace = _sample("acc_norm", LoglikelihoodAcc(LogProbCharNorm(ignore_first_space=True)),
                                             _LOGPROBS)
    loglikelihood_acc_single_token = _sample("acc", LoglikelihoodAcc(), _LOGPROBS)
    loglikelihood_acc_norm_single_token = _sample("acc_norm", LoglikelihoodAcc(LogProbCharNorm()), _LOGPROBS)
    exact_match = _sample("em", _em(strip_strings=True))
    perfect_exact_match = _sample("perfect_em", _em())
    prefix_exact_match = _sample("pem", _em(strip_strings=True, type_exact_match="prefix"))
    quasi_exact_match = _sample("qem", _em(normalize_gold=helm_normalizer, normalize_pred=helm_normalizer,
                                           strip_strings=True))
    prefix_quasi_exact_match = _sample("pqem", _em(normalize_gold=helm_normalizer, normalize_pred=helm_normalizer,
                                                   type_exact_match="prefix"))
    quasi_exact_match_math = _sample("qem", _em(strip_strings=True, normalize_pred=math_normalizer,
                                                normalize_gold=math_normalizer))
    quasi_exact_match_gsm8k = _sample("qem", _em(strip_strings=True, normalize_pred=gsm8k_normalizer,
                                                 normalize_gold=gsm8k_normalizer))
    quasi_exact_match_triviaqa = _sample("qem", _em(strip_strings=True, normalize_pred=harness_triviaqa_normalizer))
    f1_score = _sample("f1", F1_score())
    f1_score_quasi = _sample("f1_score_quasi", F1_score(normalize_gold=helm_normalizer, normalize_pred=helm_normalizer))
    pass_at_k = _sample("pass@k", PassAtK(strip_strings=True))
    maj_at_n = _sample("maj@n", MajAtN())
    target_perplexity = _native("target_perplexity", "ppl", _LOGPROBS)
    word_perplexity = _native("word_perplexity", "word_perplexity", _PPL)
    byte_perplexity = _native("byte_perplexity", "byte_perplexity", _PPL)
    bits_per_byte = _native("bits_per_byte", "bits_per_byte", _PPL)

    def __str__(self) -> str:
        return self.name.replace("_at_", "@")

    def __call__(self, sample_params: dict | None = None) -> Metric:
        return self.value(sample_params=sample_params)


# --- conversion to nano_eval metrics ---


def _sample_callable(fn) -> Callable[[Doc, ModelResponse], Any]:
    """fn as (doc, response) -> value; lighteval passes `doc=` and `model_response=` by keyword."""
    if hasattr(fn, "compute"):
        return lambda doc, response: fn.compute(doc=doc, model_response=response)
    if not callable(fn):
        raise TypeError(f"sample_level_fn {fn!r} is neither callable nor has .compute(doc, model_response)")
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    by_keyword = {"doc", "model_response"} <= set(params) or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if by_keyword:
        return lambda doc, response: fn(doc=doc, model_response=response)
    return lambda doc, response: fn(doc, response)


def _plain(value):
    """numpy scalars to Python numbers (results and details are JSON)."""
    return value.item() if isinstance(value, np.generic) else value


def _corpus(fn) -> Callable[[list], float]:
    if fn is np.mean or fn is mean:
        return mean  # nano_eval reports the analytic standard error for plain means
    if hasattr(fn, "compute_corpus"):
        return fn.compute_corpus
    return fn


class _GroupMemo:
    """One call of a grouped sample function per document, shared by the metrics that read its dict."""

    def __init__(self, fn):
        self.fn, self.last = fn, (None, None, None)

    def value(self, name: str, doc: Doc, response: ModelResponse):
        last_doc, last_response, result = self.last
        if last_doc is not doc or last_response is not response:
            result = self.fn(doc, response)
            if not isinstance(result, dict):
                raise TypeError(f"a grouped metric's sample_level_fn must return {{name: value}}, got {result!r}")
            self.last = (doc, response, result)
        return _plain(result[name])


def _extras(fn) -> dict:
    extras = {}
    if isinstance(getattr(fn, "logprob_normalization", None), LogProbPMINorm):
        extras["needs_unconditioned"] = True
    if hasattr(fn, "num_samples") and callable(fn.num_samples):
        extras["num_samples"] = fn.num_samples()
    return extras


def to_nano_metrics(metric) -> list:
    """nano_eval `Metric`s for a lighteval metric (a `Metrics` member or a `Metric` record; one per name)."""
    if isinstance(metric, Metrics):
        metric = metric.value
    if isinstance(metric, (str, NanoMetric)):
        return [metric]
    if not isinstance(metric, Metric):
        raise TypeError(f"{metric!r} is not a metric; use a Metrics member, a SampleLevelMetric or a metric name")
    if metric.batched_compute:
        raise ValueError(f"metric {metric.metric_name!r}: batched_compute=True (LLM judges) is not supported")
    rtype = SamplingMethod(metric.category).request_type
    fn, extras = _sample_callable(metric.sample_level_fn), _extras(metric.sample_level_fn)
    if not isinstance(metric.metric_name, (list, tuple)):
        return [NanoMetric(name=metric.metric_name, request_type=rtype, corpus_fn=_corpus(metric.corpus_level_fn),
                           sample_fn=lambda doc, response: _plain(fn(doc, response)),
                           higher_is_better=bool(metric.higher_is_better), **extras)]
    memo, names = _GroupMemo(fn), list(metric.metric_name)
    corpus = metric.corpus_level_fn if isinstance(metric.corpus_level_fn, dict) else dict.fromkeys(
        names, metric.corpus_level_fn)
    higher = metric.higher_is_better if isinstance(metric.higher_is_better, dict) else dict.fromkeys(
        names, metric.higher_is_better)
    return [NanoMetric(name=name, request_type=rtype, corpus_fn=_corpus(corpus[name]),
                       sample_fn=lambda doc, response, name=name: memo.value(name, doc, response),
                       higher_is_better=bool(higher[name]), **extras) for name in names]
