"""lighteval's corpus and sample computations that come from well-kept libraries, under lighteval's names.

| lighteval name | computed by |
| --- | --- |
| `MatthewsCorrCoef`, `CorpusLevelF1Score` | a few lines, equal to scikit-learn's `matthews_corrcoef` / `f1_score` |
| `CorpusLevelTranslationMetric` (bleu, chrf, chrf++, ter) | sacrebleu's corpus scores |
| `ROUGE` | Google's rouge-score |
| `BLEU` (sentence BLEU-n) | nltk's `sentence_bleu` |
| `MultilingualExtractiveMatchMetric` (math answers) | math-verify's `parse` / `verify` |
| `TruthfulqaMCMetrics`, `MRR`, `Recall`, `StringDistance`, perplexities | a few lines each (below) |

The libraries are imported when a metric is first computed: `pip install -e ".[lighteval]"` (in the
nano_eval checkout) brings them.
Sample functions return plain values or named tuples (JSON in the details files); corpus functions take the list of
them. Written for nano_eval after lighteval's documented behaviour; no lighteval code is used.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections import Counter
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from nano_eval.errors import NanoEvalError
from nano_eval.response import ModelResponse
from nano_eval.tasks.languages import Language
from nano_eval.tasks.requests import Doc

EXTRA = 'pip install -e ".[lighteval]" torch==2.13.0 (in the nano_eval checkout)'


def require(module: str, package: str):
    """Import `module`, or stop naming the package and the extra that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise NanoEvalError(f"this lighteval metric needs the package `{package}`, which is not installed ({e}). "
                            f"Fix: {EXTRA}") from e


def as_list(item) -> list:
    """lighteval's helper: a list or tuple as a list, anything else as a one-item list."""
    return list(item) if isinstance(item, (list, tuple)) else [item]


class SampleLevelComputation:
    """Base of objects used as `sample_level_fn`: `compute(doc, model_response) -> value`."""

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs):
        raise NotImplementedError


# --- corpus inputs and preparators (lighteval.metrics.sample_preparator) ---


class GenerativeCorpusMetricInput(NamedTuple):
    golds: list
    preds: list


class LogprobCorpusMetricInput(NamedTuple):
    golds: Any  # the gold indices (a list), or the first one for single-token metrics
    preds: int  # index of the choice with the highest log-prob


class PerplexityCorpusMetricInput(NamedTuple):
    logprobs: float
    weights: int


class Preparator:
    """Base of lighteval's preparators: `prepare(doc, model_response)` keeps what a corpus metric needs."""

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs):
        return self.prepare(doc=doc, model_response=model_response)


class GenerativePreparator(Preparator):
    def prepare(self, doc: Doc, model_response: ModelResponse, **kwargs) -> GenerativeCorpusMetricInput:
        return GenerativeCorpusMetricInput(golds=as_list(doc.get_golds()), preds=list(model_response.final_text))


class LoglikelihoodPreparator(Preparator):
    def __init__(self, is_single_token: bool = False):
        self.is_single_token = is_single_token

    def prepare(self, doc: Doc, model_response: ModelResponse, **kwargs) -> LogprobCorpusMetricInput:
        golds = doc.gold_indices()
        pred = int(np.argmax(model_response.logprobs[: len(doc.choices)]))
        return LogprobCorpusMetricInput(golds=golds[0] if self.is_single_token else golds, preds=pred)


def _count_units(text: str, units_type: str) -> int:
    return len(re.split(r"\s+", text)) if units_type == "words" else len(text.encode("utf-8"))


class TargetPerplexityPreparator(Preparator):
    """Log-prob of the gold choices, weighted by the words (or bytes) of the golds joined by spaces."""

    def __init__(self, units_type: str):
        if units_type not in ("words", "bytes"):
            raise ValueError(f"units_type={units_type!r}; use 'words' or 'bytes'")
        self.units_type = units_type

    def prepare(self, doc: Doc, model_response: ModelResponse, **kwargs) -> PerplexityCorpusMetricInput:
        return PerplexityCorpusMetricInput(float(np.sum(model_response.logprobs)),
                                           _count_units(" ".join(doc.get_golds()), self.units_type))


class PerplexityPreparator(TargetPerplexityPreparator):
    """Log-prob of the whole document, weighted by the words (or bytes) of its query (or original query)."""

    def prepare(self, doc: Doc, model_response: ModelResponse, **kwargs) -> PerplexityCorpusMetricInput:
        text = doc.original_query if doc.original_query is not None else doc.query
        return PerplexityCorpusMetricInput(float(np.sum(model_response.logprobs)), _count_units(text, self.units_type))


# --- corpus computations (lighteval.metrics.metrics_corpus) ---


class CorpusLevelComputation:
    """Base of corpus functions: `compute_corpus(items) -> float` over every document's sample value."""

    def compute_corpus(self, items: list) -> float:
        raise NotImplementedError

    def __call__(self, items: list) -> float:
        return self.compute_corpus(items)


def _first(x):
    return as_list(x)[0]


def matthews_corrcoef(golds: list, preds: list) -> float:
    """Multiclass Matthews correlation (Gorodkin's R_K, scikit-learn's definition; 0 when undefined)."""
    labels = sorted(set(golds) | set(preds), key=str)
    true, pred = Counter(golds), Counter(preds)
    n, correct = len(golds), sum(g == p for g, p in zip(golds, preds))
    cov_tp = correct * n - sum(true[k] * pred[k] for k in labels)
    cov_tt, cov_pp = n * n - sum(true[k] ** 2 for k in labels), n * n - sum(pred[k] ** 2 for k in labels)
    return 0.0 if cov_tt * cov_pp == 0 else cov_tp / math.sqrt(cov_tt * cov_pp)


def f1_scores(golds: list, preds: list, average: str | None):
    """scikit-learn's multiclass `f1_score` (zero where undefined): per label (sorted) when average is None, else
    their "macro" mean, support-"weighted" mean, or the "micro" F1 of all decisions (the accuracy)."""
    labels = sorted(set(golds) | set(preds), key=str)
    hits = Counter(g for g, p in zip(golds, preds) if g == p)
    true, pred = Counter(golds), Counter(preds)
    per_label = [2 * hits[k] / (true[k] + pred[k]) if true[k] + pred[k] else 0.0 for k in labels]
    if average is None:
        return per_label
    if average == "macro":
        return float(np.mean(per_label))
    if average == "weighted":
        return float(sum(f * true[k] for f, k in zip(per_label, labels)) / len(golds))
    return sum(hits.values()) / len(golds)


class MatthewsCorrCoef(CorpusLevelComputation):
    """Matthews correlation between the first gold index and the predicted index of each document (as scikit-learn's
    `matthews_corrcoef`, which the tests compare it with; written out so bootstrapping its stderr stays cheap)."""

    def compute_corpus(self, items: list) -> float:
        return matthews_corrcoef([_first(i[0]) for i in items], [_first(i[1]) for i in items])


class CorpusLevelF1Score(CorpusLevelComputation):
    """F1 between first golds and first predictions (indices or strings), as scikit-learn's `f1_score`.

    average None: the best per-class F1 (lighteval's `loglikelihood_f1`); "macro" / "micro" / "weighted": that
    average. num_classes > 2: the mean over classes i = 0..num_classes-1 of the F1 of "is class i" (`mf1`)."""

    def __init__(self, average: str | None, num_classes: int = 2):
        if average not in ("weighted", "macro", "micro", None):
            raise ValueError(f"average={average!r}; use 'weighted', 'macro', 'micro' or None")
        self.average, self.num_classes = average, num_classes

    def compute_corpus(self, items: list) -> float:
        golds, preds = [_first(i[0]) for i in items], [_first(i[1]) for i in items]
        if self.num_classes == 2:
            return float(np.max(f1_scores(golds, preds, self.average)))
        return float(np.mean([f1_scores([g == c for g in golds], [p == c for p in preds], self.average)
                              for c in range(self.num_classes)]))


class CorpusLevelTranslationMetric(CorpusLevelComputation):
    """sacrebleu's corpus BLEU / chrF / chrF++ / TER of each document's first prediction against its first gold
    (`lang` "zh", "ja" or "ko" selects sacrebleu's tokenizer for BLEU and Asian support for TER).

    Each (prediction, gold) pair's sufficient statistics are computed once and summed per corpus, as sacrebleu's
    corpus_score does, so the bootstrapped stderr re-sums statistics instead of re-tokenising."""

    def __init__(self, metric_type: str, lang: str = ""):
        if metric_type not in ("bleu", "chrf", "chrf++", "ter"):
            raise ValueError(f"metric_type={metric_type!r}; use 'bleu', 'chrf', 'chrf++' or 'ter'")
        self.metric_type, self.lang = metric_type, lang
        self._scorer, self._stats = None, {}

    def scorer(self):
        if self._scorer is None:
            sacrebleu = require("sacrebleu", "sacrebleu")
            if self.metric_type == "bleu":
                self._scorer = sacrebleu.BLEU(trg_lang=self.lang)
            elif self.metric_type == "ter":
                self._scorer = sacrebleu.TER(asian_support=bool(self.lang))
            else:
                self._scorer = sacrebleu.CHRF(word_order=2 if self.metric_type == "chrf++" else 0)
        return self._scorer

    def compute_corpus(self, items: list) -> float:
        pairs = [(_first(i[1]) if as_list(i[1]) else "", _first(i[0])) for i in items]
        scorer = self.scorer()
        if not (hasattr(scorer, "_extract_corpus_statistics") and hasattr(scorer, "_aggregate_and_compute")):
            return float(scorer.corpus_score([p for p, _ in pairs], [[r for _, r in pairs]]).score)
        for pair in pairs:
            if pair not in self._stats:
                self._stats[pair] = scorer._extract_corpus_statistics([pair[0]], [[pair[1]]])[0]
        return float(scorer._aggregate_and_compute([self._stats[pair] for pair in pairs]).score)


class CorpusLevelPerplexityMetric(CorpusLevelComputation):
    """perplexity: exp(-mean log-prob); weighted_perplexity: exp(-sum log-probs / sum weights); bits_per_byte:
    -sum log-probs / sum weights / ln 2."""

    def __init__(self, metric_type: str):
        if metric_type not in ("perplexity", "weighted_perplexity", "bits_per_byte"):
            raise ValueError(f"metric_type={metric_type!r}; use 'perplexity', 'weighted_perplexity' or 'bits_per_byte'")
        self.metric_type = metric_type

    def compute_corpus(self, items: list) -> float:
        logprobs, weights = [i[0] for i in items], [i[1] for i in items]
        if self.metric_type == "perplexity":
            return math.exp(-float(np.mean(logprobs)))
        if self.metric_type == "weighted_perplexity":
            return math.exp(-sum(logprobs) / sum(weights))
        return -sum(logprobs) / sum(weights) / math.log(2)


# --- sample computations (lighteval.metrics.metrics_sample) ---


class ROUGE(SampleLevelComputation):
    """rouge-score F-measures between each prediction and each gold, aggregated (mean by default); with
    `multiple_golds`, each prediction against all golds at once; with `bootstrap` (T5 style), the mid F-measure of
    rouge-score's bootstrap aggregate over (gold, prediction) pairs, x 100. One method: a float; several: a dict."""

    METHODS = ("rouge1", "rouge2", "rougeL", "rougeLsum")

    def __init__(self, methods: str | list[str], multiple_golds: bool = False, bootstrap: bool = False,
                 normalize_gold: Callable | None = None, normalize_pred: Callable | None = None,
                 aggregation_function: Callable | None = None, tokenizer: Any = None):
        self.methods = as_list(methods)
        unknown = [m for m in self.methods if m not in self.METHODS]
        if unknown:
            raise ValueError(f"ROUGE methods {unknown} are not among {self.METHODS}")
        self.multiple_golds, self.bootstrap, self.tokenizer = multiple_golds, bootstrap, tokenizer
        self.normalize_gold, self.normalize_pred = normalize_gold, normalize_pred
        self.aggregation_function = aggregation_function or np.mean
        self._scorer = None

    def scorer(self):
        if self._scorer is None:
            rouge_scorer = require("rouge_score.rouge_scorer", "rouge-score")
            self._scorer = rouge_scorer.RougeScorer(self.methods, tokenizer=self.tokenizer)
        return self._scorer

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs):
        golds = [self.normalize_gold(g) if self.normalize_gold else g for g in doc.get_golds()]
        preds = [self.normalize_pred(p) if self.normalize_pred else p for p in model_response.final_text]
        scorer = self.scorer()
        if self.bootstrap:
            scoring = require("rouge_score.scoring", "rouge-score")
            aggregator = scoring.BootstrapAggregator()
            for gold, pred in zip(golds, preds):
                aggregator.add_scores(scorer.score(gold, pred))
            result = aggregator.aggregate()
            scores = {m: float(result[m].mid.fmeasure * 100) for m in self.methods}
        else:
            pairs = [scorer.score_multi(golds, p) for p in preds] if self.multiple_golds else [
                scorer.score(g, p) for p in preds for g in golds]
            scores = {m: float(self.aggregation_function([s[m].fmeasure for s in pairs])) for m in self.methods}
        return scores[self.methods[0]] if len(scores) == 1 else scores


_warned_tokenizer = False


def word_tokenize(text: str) -> list[str]:
    """nltk's word_tokenize when its punkt sentence model is installed; otherwise nltk's Treebank word tokenizer on
    the whole text (the same tokens except a full stop inside the text stays on its word), said once."""
    global _warned_tokenizer
    nltk = require("nltk", "nltk")
    try:
        return nltk.word_tokenize(text)
    except LookupError:
        if not _warned_tokenizer:
            _warned_tokenizer = True
            print("nano_eval: warning: nltk's punkt data is not installed (python -m nltk.downloader punkt_tab); "
                  "sentence BLEU tokenizes with the Treebank tokenizer alone", file=sys.stderr)
        return nltk.tokenize.NLTKWordTokenizer().tokenize(text)


class BLEU(SampleLevelComputation):
    """nltk's sentence BLEU with only n-grams of size `n_gram`, every gold as a reference, averaged over the
    predictions."""

    def __init__(self, n_gram: int):
        self.n_gram = n_gram

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        bleu = require("nltk.translate.bleu_score", "nltk")
        weights = [1 if i == self.n_gram else 0 for i in range(1, 5)]
        refs = [word_tokenize(g) for g in doc.get_golds()]
        return float(np.mean([bleu.sentence_bleu(refs, word_tokenize(p), weights=weights)
                              for p in model_response.final_text]))


class Recall(SampleLevelComputation):
    """1 if a gold is among the k choices with the highest log-probs."""

    def __init__(self, k: int):
        self.k = k

    @property
    def recall_depth(self) -> int:  # lighteval's attribute name; `sample_params={"k": 2}` sets k
        return self.k

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> int:
        logprobs = np.asarray(model_response.logprobs[: len(doc.choices)])
        if self.recall_depth == 1:
            return int(int(np.argmax(logprobs)) in doc.gold_indices())
        return int(any(int(i) in doc.gold_indices() for i in logprobs.argsort()[::-1][: self.recall_depth]))


class MRR(SampleLevelComputation):
    """1 / (1 + rank of the best-ranked gold) among the choices by log-prob (per character with
    `length_normalization`)."""

    def __init__(self, length_normalization: bool = False):
        self.length_normalization = length_normalization

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        logprobs = list(model_response.logprobs[: len(doc.choices)])
        if self.length_normalization:
            logprobs = [lp / len(c) for lp, c in zip(logprobs, doc.choices)]
        ranked = sorted(logprobs, reverse=True)
        return 1.0 / (min(ranked.index(logprobs[g]) for g in doc.gold_indices()) + 1)


class TruthfulqaMCMetrics(SampleLevelComputation):
    """TruthfulQA mc1 and mc2 from one document holding both target lists (lighteval's truthfulqa prompt):
    the first `doc.specific["len_mc1"]` choices are mc1's (its gold first), the rest mc2's; `gold_index` lists
    mc1's gold then mc2's golds, which come first in mc2's list.

    mc1: 1 if mc1's first choice has the highest log-prob. mc2: the probability mass of the true answers,
    normalised over all of mc2's answers (as lm-eval's truthfulqa_mc2). As lighteval does, mc2's true answers end at
    the first gap in the gold indices."""

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> dict:
        golds = doc.gold_indices()
        len_mc1 = doc.specific["len_mc1"]
        last = golds[1]
        for g in golds[2:]:
            if g != last + 1:
                break
            last = g
        mc1, mc2 = model_response.logprobs[:len_mc1], np.asarray(model_response.logprobs[len_mc1:len(doc.choices)])
        split = last - len_mc1 + 1
        probs = np.exp(mc2)
        return {"truthfulqa_mc1": int(np.argmax(mc1) == 0), "truthfulqa_mc2": float(probs[:split].sum() / probs.sum())}


class StringDistance(SampleLevelComputation):
    """Longest common prefix length (in characters), edit distance (nltk's Levenshtein over characters) and
    edit similarity (1 - distance / longer length) between the first gold and the (stripped) first prediction."""

    KINDS = ("longest_common_prefix_length", "edit_distance", "edit_similarity")

    def __init__(self, metric_types: list[str] | str, strip_prediction: bool = True):
        self.metric_types = as_list(metric_types)
        unknown = [m for m in self.metric_types if m not in self.KINDS]
        if unknown:
            raise ValueError(f"StringDistance metric types {unknown} are not among {self.KINDS}")
        self.strip_prediction = strip_prediction

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> dict:
        gold = doc.get_golds()[0]
        pred = model_response.final_text[0].strip() if self.strip_prediction else model_response.final_text[0]
        out = {}
        if "longest_common_prefix_length" in self.metric_types:
            n = 0
            while n < min(len(gold), len(pred)) and gold[n] == pred[n]:
                n += 1
            out["longest_common_prefix_length"] = n
        distance = require("nltk.metrics.distance", "nltk").edit_distance(gold, pred)
        if "edit_distance" in self.metric_types:
            out["edit_distance"] = distance
        if "edit_similarity" in self.metric_types:
            out["edit_similarity"] = 1.0 - distance / max(len(gold), len(pred), 1)
        return out


# --- math answers: math-verify (lighteval.metrics.dynamic_metrics.MultilingualExtractiveMatchMetric) ---


class IndicesExtractionConfig:
    """lighteval's letter-answer extraction (for `gpqa_instruct_*`, `pass_at_k_letters`): accepted so files load;
    a metric using it refuses its task (nano_eval has no port of lighteval's per-language letter regexes)."""

    def __init__(self, prefix_for_extraction: str = "NativeLetters", try_extract_without_anchor: bool = True):
        self.prefix_for_extraction, self.try_extract_without_anchor = prefix_for_extraction, try_extract_without_anchor

    def __repr__(self) -> str:
        return f"IndicesExtractionConfig(prefix_for_extraction={self.prefix_for_extraction!r})"


class ExprExtractionConfig:
    """math-verify's `ExprExtractionConfig` (plain expressions such as "1/2"), recorded with its arguments and built
    when the metric is computed, so files import it without loading math-verify (and sympy)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.kwargs.items())})"


class LatexExtractionConfig(ExprExtractionConfig):
    """math-verify's `LatexExtractionConfig` (LaTeX answers, `\\boxed{}` first with boxed_match_priority=0), recorded."""


def _real_config(config):
    """The math-verify config for `config` (one of the records above, or already math-verify's own)."""
    import math_verify

    if isinstance(config, LatexExtractionConfig):
        return math_verify.LatexExtractionConfig(**config.kwargs)
    if isinstance(config, ExprExtractionConfig):
        return math_verify.ExprExtractionConfig(**config.kwargs)
    return config


class MultilingualExtractiveMatchMetric(SampleLevelComputation):
    """1.0 if an answer math-verify extracts from a prediction equals (math-verify's `verify`, `precision` decimals) an
    answer extracted from a gold, aggregated over predictions (max by default); a gold nothing is extracted from is
    compared as it is. Extraction anchors are math-verify's (English) whatever `language` says."""

    def __init__(self, language: Language = Language.ENGLISH,
                 gold_extraction_target: Sequence = (ExprExtractionConfig(),),
                 pred_extraction_target: Sequence = (ExprExtractionConfig(), LatexExtractionConfig()),
                 aggregation_function: Callable = max, fallback_mode: str = "first_match",
                 extraction_mode: str = "any_match", precision: int = 6, timeout_seconds: int = 5):
        self.language, self.aggregation_function = language, aggregation_function
        self.gold_extraction_target, self.pred_extraction_target = gold_extraction_target, pred_extraction_target
        self.fallback_mode, self.extraction_mode = fallback_mode, extraction_mode
        self.precision, self.timeout_seconds = precision, timeout_seconds

    def unsupported_reason(self) -> str | None:
        if any(isinstance(c, IndicesExtractionConfig)
               for c in [*self.gold_extraction_target, *self.pred_extraction_target]):
            return "it extracts letter answers (IndicesExtractionConfig), whose per-language regexes are not ported"
        return None

    def _parse(self, text: str, targets) -> list:
        math_verify = require("math_verify", "math-verify")
        return math_verify.parse(text, [_real_config(c) for c in targets], fallback_mode=self.fallback_mode,
                                 extraction_mode=self.extraction_mode, parsing_timeout=self.timeout_seconds)

    def compute(self, doc: Doc, model_response: ModelResponse, **kwargs) -> float:
        math_verify = require("math_verify", "math-verify")
        golds = doc.get_golds()
        extracted_golds = [self._parse(g, self.gold_extraction_target) for g in golds]
        if any(not g for g in extracted_golds):
            extracted_golds = [[g] for g in golds]
        preds = [self._parse(p, self.pred_extraction_target) for p in model_response.final_text]
        if doc.specific is None:
            doc.specific = {}
        doc.specific["extracted_predictions"] = [str(x) for p in preds for x in p]
        doc.specific["extracted_golds"] = [str(x) for g in extracted_golds for x in g]
        return self.aggregation_function([
            1.0 if any(math_verify.verify(g, p, float_rounding=self.precision, timeout_seconds=self.timeout_seconds)
                       for g in extracted_golds) else 0.0
            for p in preds])
