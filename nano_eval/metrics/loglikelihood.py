"""Metrics over log-probabilities: multiple-choice accuracy variants, gold-choice probability, perplexities.

For multiple choice `response.logprobs[i]` is the summed log-prob of `doc.choices[i]`; for rolling perplexity
`response.logprobs[0]` is the log-prob of the whole `doc.query`. Ties go to the first index (np.argmax), as in
lm-eval, so our accuracies match its numbers exactly.
"""

from __future__ import annotations

import math
import re

import numpy as np

from nano_eval.response import ModelResponse
from nano_eval.tasks.requests import Doc

LN2 = math.log(2)


def count_words(text: str) -> int:
    """Word count used by lm-eval's rolling perplexity (a leading/trailing space counts as an empty word)."""
    return len(re.split(r"\s+", text))


def count_bytes(text: str) -> int:
    return len(text.encode("utf-8"))


def _hit(doc: Doc, scores) -> float:
    """1.0 when the highest-scoring choice (first one on ties) is a gold index."""
    return 1.0 if int(np.argmax(np.asarray(scores, dtype=np.float64))) in doc.gold_indices() else 0.0


def _lls(response: ModelResponse) -> np.ndarray:
    return np.asarray(response.logprobs, dtype=np.float64)


def _best_gold(doc: Doc, response: ModelResponse) -> int:
    """With several golds, the one the model likes most (first on ties) stands for the document."""
    golds = doc.gold_indices()
    return golds[int(np.argmax([response.logprobs[g] for g in golds]))]


# --- multiple-choice accuracies ---


def acc(doc: Doc, response: ModelResponse) -> float:
    return _hit(doc, _lls(response))


def acc_norm(doc: Doc, response: ModelResponse) -> float:
    """Log-prob per character of the choice without its one leading space: lm-eval divides by the length of the
    choice text, and the space joining context and choice is its target_delimiter, not part of the choice."""
    lengths = np.asarray([float(len(c.removeprefix(" "))) for c in doc.choices])
    return _hit(doc, _lls(response) / lengths)


def acc_golds_likelihood(doc: Doc, response: ModelResponse) -> float:
    """1.0 when greedy decoding after the context yields exactly a gold continuation (lm-eval's LAMBADA `acc`)."""
    return float(any(response.argmax_logits_eq_gold[g] for g in doc.gold_indices()))


def acc_norm_token(doc: Doc, response: ModelResponse) -> float:
    """Log-prob per token of the choice, which does not depend on how the tokenizer spells characters."""
    return _hit(doc, _lls(response) / np.asarray(response.continuation_token_counts, dtype=np.float64))


def acc_norm_pmi(doc: Doc, response: ModelResponse) -> float:
    """log P(choice | query) - log P(choice | unconditioned query): removes the prior of frequent answers."""
    if response.unconditioned_logprobs is None:
        raise ValueError(
            "acc_norm_pmi needs response.unconditioned_logprobs; the task must request log P(choice | "
            "doc.unconditioned_query) (Metric.needs_unconditioned=True)"
        )
    return _hit(doc, _lls(response) - np.asarray(response.unconditioned_logprobs, dtype=np.float64))


# --- gold-choice probabilities ---


def prob_gold(doc: Doc, response: ModelResponse) -> float:
    return math.exp(response.logprobs[_best_gold(doc, response)])


def prob_norm_gold(doc: Doc, response: ModelResponse) -> float:
    """Probability of the gold choice(s) after renormalising over the offered choices (stable softmax)."""
    lls = _lls(response)
    probs = np.exp(lls - lls.max())
    probs /= probs.sum()
    return float(sum(probs[g] for g in set(doc.gold_indices())))


def bits_per_byte_gold(doc: Doc, response: ModelResponse) -> float:
    g = _best_gold(doc, response)
    return -response.logprobs[g] / (LN2 * count_bytes(doc.choices[g]))


def target_perplexity_sample(doc: Doc, response: ModelResponse) -> tuple[float, int]:
    """(log-prob, whitespace-separated words) of the gold choice; words exclude the leading space."""
    g = _best_gold(doc, response)
    return (response.logprobs[g], len(doc.choices[g].split()))


# --- rolling log-likelihood of doc.query ---


def rolling_words(doc: Doc, response: ModelResponse) -> tuple[float, int]:
    return (response.logprobs[0], count_words(doc.query))


def rolling_bytes(doc: Doc, response: ModelResponse) -> tuple[float, int]:
    return (response.logprobs[0], count_bytes(doc.query))


# --- corpus aggregations over (log-prob, weight) pairs ---


def _weighted_mean(items: list) -> float:
    lls, weights = zip(*items)
    return sum(lls) / sum(weights)


def weighted_perplexity(items: list) -> float:
    """exp(-sum log-prob / sum units): every word/byte of the corpus counts the same, not every document."""
    return math.exp(-_weighted_mean(items))


def weighted_bits_per_byte(items: list) -> float:
    return -_weighted_mean(items) / LN2
