"""Metrics over generated text: exact / quasi-exact match, GSM8K-style numeric match, pass@k and maj@k.

Predictions are `response.final_text` (one string per sample), references `doc.golds()`. A gold containing
"####" (GSM8K style: "... #### 72") switches pass@k / maj@k to numeric answer comparison.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter

from nano_eval.response import ModelResponse
from nano_eval.tasks.requests import Doc

NUMERIC_TOLERANCE = 1e-6
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")
_ANSWER_IS = re.compile(r"the answer is", flags=re.IGNORECASE)


def normalize_text(text: str) -> str:
    """SQuAD-style: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def _to_float(token: str) -> float:
    return float(token.replace("$", "").replace(",", ""))


def extract_number(text: str) -> float | None:
    """The answer number of a text: after "####", else after "The answer is", else the last number; None if none.

    Commas and "$" are dropped and a trailing period is not part of the number ("$1,234." -> 1234.0).
    """
    for marker in ("####", _ANSWER_IS):
        parts = text.split(marker, 1) if isinstance(marker, str) else marker.split(text, 1)
        if len(parts) == 2:
            found = _NUMBER.search(parts[1])
            if found:
                return _to_float(found.group())
    numbers = _NUMBER.findall(text)
    return _to_float(numbers[-1]) if numbers else None


def numbers_equal(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(a - b) <= NUMERIC_TOLERANCE


def is_gsm8k_style(doc: Doc) -> bool:
    return any("####" in g for g in doc.golds())


def _first_prediction(response: ModelResponse) -> str:
    texts = response.final_text
    return texts[0] if texts else ""


def exact_match(doc: Doc, response: ModelResponse) -> float:
    pred = _first_prediction(response).strip()
    return float(any(pred == g.strip() for g in doc.golds()))


def quasi_exact_match(doc: Doc, response: ModelResponse) -> float:
    pred = normalize_text(_first_prediction(response))
    return float(any(pred == normalize_text(g) for g in doc.golds()))


def gsm8k_match(doc: Doc, response: ModelResponse) -> float:
    pred = extract_number(_first_prediction(response))
    return float(any(numbers_equal(pred, extract_number(g)) for g in doc.golds()))


# --- sampling metrics ---


def _answer_key(doc: Doc, prediction: str):
    """What two predictions must share to count as the same answer (a number, or normalised text)."""
    return extract_number(prediction) if is_gsm8k_style(doc) else normalize_text(prediction)


def _key_is_correct(doc: Doc, key) -> bool:
    if key is None:
        return False
    if is_gsm8k_style(doc):
        return any(numbers_equal(key, extract_number(g)) for g in doc.golds())
    return any(key == normalize_text(g) for g in doc.golds())


def _check_samples(name: str, k: int, predictions: list[str]) -> None:
    if len(predictions) < k:
        raise ValueError(
            f"{name} needs at least {k} predictions per document but got {len(predictions)}; "
            f"raise num_samples (generations per document) to >= {k}"
        )


def pass_at_k_estimate(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): chance that a random k-subset of n samples holds one of the c correct."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k(k: int, doc: Doc, response: ModelResponse) -> float:
    preds = response.final_text
    _check_samples(f"pass@{k}", k, preds)
    correct = sum(_key_is_correct(doc, _answer_key(doc, p)) for p in preds)
    return pass_at_k_estimate(len(preds), correct, k)


def maj_at_k(k: int, doc: Doc, response: ModelResponse) -> float:
    """Majority vote over the first k answers (first seen wins ties); predictions without an answer don't vote."""
    preds = response.final_text
    _check_samples(f"maj@{k}", k, preds)
    votes = Counter(key for key in (_answer_key(doc, p) for p in preds[:k]) if key is not None)
    if not votes:
        return 0.0
    return float(_key_is_correct(doc, votes.most_common(1)[0][0]))
