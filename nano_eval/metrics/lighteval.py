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

from nano_eval.metrics import lighteval_scores as scores
from nano_eval.metrics.lighteval_scores import (BLEU, MRR, ROUGE, CorpusLevelComputation, CorpusLevelF1Score,
                                                CorpusLevelPerplexityMetric, CorpusLevelTranslationMetric,
                                                ExprExtractionConfig, GenerativePreparator, IndicesExtractionConfig,
                                                LatexExtractionConfig, LoglikelihoodPreparator, MatthewsCorrCoef,
                                                MultilingualExtractiveMatchMetric, PerplexityPreparator, Preparator,
                                                Recall, SampleLevelComputation, StringDistance,
                                                TargetPerplexityPreparator, TruthfulqaMCMetrics)
from nano_eval.metrics.metric import Metric as NanoMetric
from nano_eval.metrics.metric import mean
from nano_eval.metrics.normalizations import (LogProbCharNorm, LogProbPMINorm, LogProbTokenNorm, bigbench_normalizer,
                                              get_multilingual_normalizer, gsm8k_normalizer,
                                              harness_triviaqa_normalizer, helm_normalizer, math_normalizer,
                                              normalize_log_probs, remove_braces, remove_braces_and_strip)
from nano_eval.metrics.registry import METRICS
from nano_eval.response import ModelResponse
from nano_eval.tasks.languages import Language
from nano_eval.tasks.requests import Doc, SamplingMethod

# --- sample-level computations (lighteval's classes, same constructor arguments) ---


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
    """Shared by pass@k, maj@n and avg@n: `normalize` / `strip_strings` on both sides, then an exact (or prefix /
    suffix) match, or `sample_scoring_function` (a function or computation of (doc, model_response), e.g. a math
    answer check) on a document holding the preprocessed golds and a response holding one preprocessed prediction."""

    def __init__(self, normalize: Callable | str | None = None, strip_strings: bool = False,
                 sample_scoring_function: Any = None):
        if isinstance(normalize, str):  # lighteval accepts a normaliser by its name
            from nano_eval.metrics import normalizations

            if not callable(getattr(normalizations, normalize, None)):
                raise ValueError(f"unknown normalization function {normalize!r}")
            normalize = getattr(normalizations, normalize)
        self.normalize, self.strip_strings = normalize, strip_strings
        self.sample_scoring_function = sample_scoring_function
        if isinstance(sample_scoring_function, str) and sample_scoring_function not in ("prefix", "suffix", "full"):
            raise ValueError(f"sample_scoring_function={sample_scoring_function!r}; use 'full', 'prefix', 'suffix' "
                             "or a function of (doc, model_response)")

    def unsupported_reason(self) -> str | None:
        check = getattr(self.sample_scoring_function, "unsupported_reason", None)
        return check() if check else None

    def preprocess(self, text):
        if isinstance(text, (list, tuple)):
            return [self.preprocess(t) for t in text]
        text = text.strip() if self.strip_strings and text else text or ""
        return self.normalize(text) if self.normalize is not None else text

    def score(self, doc: Doc, pred: str) -> float:
        """One prediction's score against the document's (first) gold."""
        scorer = self.sample_scoring_function
        if scorer is None or isinstance(scorer, str):
            return _matches(self.preprocess(doc.get_golds()[0]), self.preprocess(pred), scorer or "full")
        new_doc = Doc(query=doc.query, choices=self.preprocess(list(doc.choices)), gold_index=doc.gold_index,
                      specific=doc.specific)
        return float(_sample_callable(scorer)(new_doc, ModelResponse(text=[self.preprocess(pred)])))


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
        c = sum(self.score(doc, p) == 1 for p in preds)
        return 1.0 - math.comb(len(preds) - c, self.k) / math.comb(len(preds), self.k)


class MajAtN(_SamplingMetric):
    """Is the most frequent of the first n (preprocessed) predictions the gold? (first seen wins ties)."""

    def __init__(self, n: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def num_samples(self) -> int:
        return self.n or 1

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        if self.n is None:
            raise ValueError("maj@n needs n: Metrics.maj_at_n(sample_params={'n': 4})")
        answers = [self.preprocess(p) for p in model_response.final_text[: self.n]]
        majority = Counter(answers).most_common(1)[0][0] if answers else ""
        return self.score(doc, majority)


class AvgAtN(_SamplingMetric):
    """Mean score of the first n predictions."""

    def __init__(self, n: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.n = n

    def num_samples(self) -> int:
        return self.n or 1

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        if self.n is None:
            raise ValueError("avg@n needs n: Metrics.avg_at_n(sample_params={'n': 4})")
        return float(np.mean([self.score(doc, p) for p in model_response.final_text[: self.n]]))


class Probability(SampleLevelComputation):
    """Probability of the gold choice(s) (exp of the normalised log-prob), aggregated over golds (max)."""

    def __init__(self, normalization=None, aggregation_function: Callable = np.max):
        self.normalization, self.aggregation_function = normalization, aggregation_function

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        scores = _normalized(self.normalization, doc, model_response)
        return float(self.aggregation_function([math.exp(scores[g]) for g in doc.gold_indices()]))


class NormalizedMultiChoiceProbability(SampleLevelComputation):
    """The gold choice's share of the probability of all choices (softmax of normalised log-probs), over golds."""

    def __init__(self, log_prob_normalization=None, aggregation_function: Callable = np.max):
        self.log_prob_normalization, self.aggregation_function = log_prob_normalization, aggregation_function

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        scores = np.asarray(_normalized(self.log_prob_normalization, doc, model_response), dtype=np.float64)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        return float(self.aggregation_function([probs[g] for g in doc.gold_indices()]))


def _normalized(normalization, doc: Doc, model_response: ModelResponse) -> list[float]:
    n = len(doc.choices)
    return normalize_log_probs(normalization, model_response.logprobs[:n], model_response.unconditioned_logprobs,
                               doc.choices, model_response.continuation_token_counts)


class JudgeLLM(SampleLevelComputation):
    """lighteval's LLM-as-judge base: accepted (and subclassable) so files load; a metric using it refuses its task
    (an LLM judge needs a judge model or API, which nano_eval does not call)."""

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def unsupported_reason(self) -> str:
        return f"it is an LLM judge ({type(self).__name__}): nano_eval calls no judge model or API"


JudgeLM = JudgeLLM


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


class UnsupportedMetric(Metric):
    """A lighteval metric nano_eval cannot compute: a file may name it (its tasks list); a task using it stops with
    `reason` when selected. `sample_level_fn` holds the reason."""

    def __init__(self, metric_name: str | list[str], reason: str):
        super().__init__(metric_name=metric_name, higher_is_better=True, category=SamplingMethod.GENERATIVE,
                         sample_level_fn=reason, corpus_level_fn=None)

    def __call__(self, sample_params: dict | None = None):
        return self


class MetricRefused(ValueError):
    """A metric nano_eval cannot compute; the message says which and why."""


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


# --- lighteval's metric factories (lighteval.metrics.dynamic_metrics) ---


def _norm_suffix(normalization) -> str:
    return f"_{normalization.name}" if normalization else ""


class LogLikelihoodAccMetric(SampleLevelMetric):
    """Accuracy under a log-prob normalisation, named "acc" + "_<normalisation name>"."""

    def __init__(self, normalization=None):
        super().__init__(metric_name="acc" + _norm_suffix(normalization), higher_is_better=True,
                         category=SamplingMethod.LOGPROBS, corpus_level_fn=np.mean,
                         sample_level_fn=LoglikelihoodAcc(logprob_normalization=normalization))


class ProbabilityMetric(SampleLevelMetric):
    def __init__(self, normalization=None, aggregation_function: Callable = np.max):
        super().__init__(metric_name="prob" + _norm_suffix(normalization), higher_is_better=True,
                         category=SamplingMethod.LOGPROBS, corpus_level_fn=np.mean,
                         sample_level_fn=Probability(normalization, aggregation_function))


class NormalizedMultiChoiceProbMetric(SampleLevelMetric):
    def __init__(self, normalization=None, aggregation_function: Callable = np.max):
        super().__init__(metric_name="normalized_mc_prob" + _norm_suffix(normalization), higher_is_better=True,
                         category=SamplingMethod.LOGPROBS, corpus_level_fn=np.mean,
                         sample_level_fn=NormalizedMultiChoiceProbability(normalization, aggregation_function))


class MultilingualQuasiF1ScoreMetric(SampleLevelMetric):
    """Bag-of-words F1 after the language's answer normaliser, named "f1_<language code>"."""

    def __init__(self, language: Language, aggregation_function: Callable = max):
        norm = get_multilingual_normalizer(language)
        super().__init__(metric_name=f"f1_{language.value}", higher_is_better=True, corpus_level_fn=np.mean,
                         category=SamplingMethod.GENERATIVE,
                         sample_level_fn=F1_score(aggregation_function, normalize_gold=norm, normalize_pred=norm))


class MultilingualQuasiExactMatchMetric(SampleLevelMetric):
    """Exact (or prefix / suffix) match after the language's answer normaliser, named
    "exact_match_<language code>_<match_type>"."""

    def __init__(self, language: Language, match_type: str = "full", aggregation_function: Callable = max):
        norm = get_multilingual_normalizer(language)
        super().__init__(metric_name=f"exact_match_{language.value}_{match_type}", higher_is_better=True,
                         corpus_level_fn=np.mean, category=SamplingMethod.GENERATIVE,
                         sample_level_fn=ExactMatches(aggregation_function, normalize_gold=norm, normalize_pred=norm,
                                                      type_exact_match=match_type))


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


def _grouped(names: list[str], fn, category=_GEN, corpus=np.mean, higher=True) -> SampleLevelMetricGrouping:
    return SampleLevelMetricGrouping(metric_name=names, sample_level_fn=fn, category=category,
                                     corpus_level_fn=dict.fromkeys(names, corpus), higher_is_better=dict.fromkeys(
                                         names, higher))


def _corpus_metric(name, preparator, corpus, category=_GEN, higher=True) -> CorpusLevelMetric:
    return CorpusLevelMetric(metric_name=name, sample_level_fn=preparator, category=category, corpus_level_fn=corpus,
                             higher_is_better=higher)


def _math(gold, pred, precision=6, **kw) -> MultilingualExtractiveMatchMetric:
    return MultilingualExtractiveMatchMetric(Language.ENGLISH, gold_extraction_target=gold,
                                             pred_extraction_target=pred, precision=precision, **kw)


_EXPR, _LATEX = ExprExtractionConfig, LatexExtractionConfig
_LETTERS = IndicesExtractionConfig(prefix_for_extraction="NativeLetters", try_extract_without_anchor=True)
_MODEL = "it scores with a neural model ({}) that nano_eval does not download or run"
_SUMMARY = ("summarization_coverage", "summarization_density", "summarization_compression")
_COPYRIGHT = ["longest_common_prefix_length", "edit_distance", "edit_similarity"]
_ROUGE = ["rouge1", "rouge2", "rougeL", "rougeLsum"]


class _MetricsMeta(enum.EnumMeta):
    def __getattr__(cls, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        raise AttributeError(
            f"Metrics.{name} does not exist (lighteval has no such member either); members: "
            f"{', '.join(m.name for m in cls)}. Or define a SampleLevelMetric with your own sample_level_fn.")


class Metrics(enum.Enum, metaclass=_MetricsMeta):
    """lighteval's metrics by member name (all of them); `Metrics.x(sample_params={...})` parametrises a copy.
    Members nano_eval cannot compute are `UnsupportedMetric`s: files naming them load, their tasks refuse to run."""

    acc_golds_likelihood = _sample("acc", AccGoldLikelihood(), _LOGPROBS)
    avg_at_n = _sample("avg@n", AvgAtN(strip_strings=True))
    avg_at_n_math = _sample("avg@n", AvgAtN(sample_scoring_function=_math([_EXPR(), _LATEX()], [_EXPR(), _LATEX()])))
    bert_score = UnsupportedMetric(["BERTScore-P", "BERTScore-R", "BERTScore-F"], _MODEL.format("BERTScore"))
    bits_per_byte = _native("bits_per_byte", "bits_per_byte", _PPL)
    bleu = _corpus_metric("bleu", GenerativePreparator(), CorpusLevelTranslationMetric("bleu"))
    bleu_1 = _sample("bleu_1", BLEU(n_gram=1))
    bleu_4 = _sample("bleu_4", BLEU(n_gram=4))
    bleurt = UnsupportedMetric("bleurt", _MODEL.format("BLEURT"))
    byte_perplexity = _native("byte_perplexity", "byte_perplexity", _PPL)
    chrf = _corpus_metric("chrf", GenerativePreparator(), CorpusLevelTranslationMetric("chrf"))
    chrf_plus = _corpus_metric("chrf++", GenerativePreparator(), CorpusLevelTranslationMetric("chrf++"))
    copyright = SampleLevelMetricGrouping(
        metric_name=_COPYRIGHT, sample_level_fn=StringDistance(_COPYRIGHT, strip_prediction=True), category=_GEN,
        corpus_level_fn={"longest_common_prefix_length": max, "edit_distance": min, "edit_similarity": max},
        higher_is_better={"longest_common_prefix_length": True, "edit_distance": False, "edit_similarity": True})
    drop = UnsupportedMetric(["em", "f1"], "DROP's answer alignment (lm-eval's drop metric) is not ported")
    exact_match = _sample("em", _em(strip_strings=True))
    expr_gold_metric = _sample("extractive_match", _math((_EXPR(),), (_EXPR(), _LATEX(boxed_match_priority=0)),
                                                         precision=5))
    extractiveness = UnsupportedMetric(list(_SUMMARY), "it needs spaCy language models, which nano_eval does not "
                                                       "download")
    extractiveness_de = extractiveness_fr = extractiveness_it = extractiveness
    f1_score = _sample("f1", F1_score())
    f1_score_macro = _corpus_metric("f1", GenerativePreparator(), CorpusLevelF1Score(average="macro"))
    f1_score_micro = _corpus_metric("f1", GenerativePreparator(), CorpusLevelF1Score(average="micro"))
    faithfulness = UnsupportedMetric("summac", _MODEL.format("SummaC"))
    g_pass_at_k = UnsupportedMetric("g-pass@k", "G-Pass@k is not ported to nano_eval")
    g_pass_at_k_math = UnsupportedMetric("math-g-pass@k", "G-Pass@k is not ported to nano_eval")
    g_pass_at_k_latex = UnsupportedMetric("latex-g-pass@k", "G-Pass@k is not ported to nano_eval")
    loglikelihood_acc = _sample("acc", LoglikelihoodAcc(), _LOGPROBS)
    loglikelihood_acc_norm = _sample("acc_norm", LoglikelihoodAcc(LogProbCharNorm()), _LOGPROBS)
    loglikelihood_acc_norm_nospace = _sample("acc_norm", LoglikelihoodAcc(LogProbCharNorm(ignore_first_space=True)),
                                             _LOGPROBS)
    loglikelihood_acc_single_token = _sample("acc", LoglikelihoodAcc(), _LOGPROBS)
    loglikelihood_acc_norm_single_token = _sample("acc_norm", LoglikelihoodAcc(LogProbCharNorm()), _LOGPROBS)
    loglikelihood_f1 = _corpus_metric("loglikelihood_f1", LoglikelihoodPreparator(), CorpusLevelF1Score(None),
                                      _LOGPROBS)
    maj_at_n = _sample("maj@n", MajAtN())
    mcc = _corpus_metric("mcc", LoglikelihoodPreparator(), MatthewsCorrCoef(), _LOGPROBS)
    mrr = _sample("mrr", MRR(), _LOGPROBS)
    multi_f1_numeric = _corpus_metric("mf1", LoglikelihoodPreparator(is_single_token=True),
                                      CorpusLevelF1Score(average="micro", num_classes=3), _LOGPROBS)
    pass_at_k = _sample("pass@k", PassAtK(strip_strings=True))
    pass_at_k_math = _sample("pass@k", PassAtK(strip_strings=True, sample_scoring_function=_math(
        [_EXPR(), _LATEX()], [_EXPR(), _LATEX()])))
    pass_at_k_letters = _sample("pass@k", PassAtK(sample_scoring_function=_math([_LETTERS], [_LETTERS])))
    prediction_perplexity = _corpus_metric("ppl", PerplexityPreparator("words"), CorpusLevelPerplexityMetric(
        "perplexity"), _PPL)
    recall_at_k = _sample("recall", Recall(k=1), _LOGPROBS)
    rouge_t5 = CorpusLevelMetricGrouping(
        metric_name=_ROUGE, sample_level_fn=ROUGE(_ROUGE, bootstrap=True, normalize_gold=bigbench_normalizer,
                                                  normalize_pred=bigbench_normalizer),
        category=_GEN, corpus_level_fn=dict.fromkeys(_ROUGE, np.mean), higher_is_better=dict.fromkeys(_ROUGE, True))
    rouge1 = _sample("rouge1", ROUGE("rouge1"))
    rouge2 = _sample("rouge2", ROUGE("rouge2"))
    rougeL = _sample("rougeL", ROUGE("rougeL"))  # noqa: N815 (lighteval's name)
    rougeLsum = _sample("rougeLsum", ROUGE("rougeLsum"))  # noqa: N815
    simpleqa_judge = UnsupportedMetric(["simpleqa_judge"], JudgeLLM().unsupported_reason().replace(
        "JudgeLLM", "JudgeLLMSimpleQA"))
    target_perplexity = _native("target_perplexity", "ppl", _LOGPROBS)
    ter = _corpus_metric("ter", GenerativePreparator(), CorpusLevelTranslationMetric("ter"), higher=False)
    truthfulqa_mc_metrics = _grouped(["truthfulqa_mc1", "truthfulqa_mc2"], TruthfulqaMCMetrics(), _LOGPROBS)
    word_perplexity = _native("word_perplexity", "word_perplexity", _PPL)
    gpqa_instruct_metric = _sample("extractive_match", _math([_LETTERS], [_LETTERS]))
    gpqa_instruct_pass_at_k = _sample("gpqa_pass@k", PassAtK(sample_scoring_function=_math([_LETTERS], [_LETTERS])))
    # members of older lighteval versions, still named by older files
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
    f1_score_quasi = _sample("f1_score_quasi", F1_score(normalize_gold=helm_normalizer, normalize_pred=helm_normalizer))

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
    normalizations = [getattr(fn, a, None) for a in ("logprob_normalization", "normalization", "log_prob_normalization")]
    if any(isinstance(n, LogProbPMINorm) for n in normalizations):
        extras["needs_unconditioned"] = True
    if hasattr(fn, "num_samples") and callable(fn.num_samples):
        extras["num_samples"] = fn.num_samples()
    return extras


def refusal(metric) -> str | None:
    """Why nano_eval cannot compute this lighteval metric record, or None."""
    if isinstance(metric, UnsupportedMetric):
        return metric.sample_level_fn
    if metric.batched_compute:
        return "it is computed in batches (batched_compute=True: LLM judges), which nano_eval does not do"
    check = getattr(metric.sample_level_fn, "unsupported_reason", None)
    return check() if callable(check) else None


def to_nano_metrics(metric) -> list:
    """nano_eval `Metric`s for a lighteval metric (a `Metrics` member or a `Metric` record; one per name).

    Raises MetricRefused naming the metric and why when nano_eval cannot compute it, TypeError for a non-metric."""
    label = f"Metrics.{metric.name}" if isinstance(metric, Metrics) else None
    if isinstance(metric, Metrics):
        metric = metric.value
    if isinstance(metric, (str, NanoMetric)):
        return [metric]
    if not isinstance(metric, Metric):
        raise TypeError(f"{metric!r} is not a metric; use a Metrics member, a SampleLevelMetric or a metric name")
    why = refusal(metric)
    if why:
        raise MetricRefused(f"metric `{label or '/'.join(_as_list(metric.metric_name))}`: {why}")
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
