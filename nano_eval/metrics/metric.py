"""The `Metric` record: how to score one document, how to aggregate a corpus, and how sure we are of it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from nano_eval.response import ModelResponse
from nano_eval.tasks.requests import Doc, RequestType

BOOTSTRAP_SEED = 1234
BOOTSTRAP_ITERS = 1000


def mean(values: list) -> float:
    """Plain mean; `Metric.stderr` recognises this exact function and uses the analytic standard error."""
    return float(np.mean(np.asarray(values, dtype=np.float64)))


def mean_stderr(values: list) -> float:
    """Sample std (ddof=1) / sqrt(n), the same estimate as lm-eval's `mean_stderr`."""
    x = np.asarray(values, dtype=np.float64)
    return float(np.std(x, ddof=1) / math.sqrt(len(x)))


def bootstrap_stderr(corpus_fn: Callable[[list], float], values: list, iters: int = BOOTSTRAP_ITERS) -> float:
    """Std (ddof=1) of `corpus_fn` over resampled corpora; the seed is fixed so reruns report the same number."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    n = len(values)
    stats = [corpus_fn([values[i] for i in rng.integers(0, n, size=n)]) for _ in range(iters)]
    return float(np.std(np.asarray(stats, dtype=np.float64), ddof=1))


@dataclass(frozen=True, kw_only=True)
class Metric:
    """One metric: `sample_fn` scores a document, `corpus_fn` turns all sample values into the reported number.

    `needs_unconditioned` asks the task to also score each choice after `doc.unconditioned_query` (PMI);
    `num_samples` is how many generations per document the task must request (pass@k / maj@k need k).
    """

    name: str
    request_type: RequestType
    sample_fn: Callable[[Doc, ModelResponse], float | tuple]
    corpus_fn: Callable[[list], float]
    higher_is_better: bool = True
    needs_unconditioned: bool = False
    num_samples: int = 1

    def compute(self, doc: Doc, response: ModelResponse) -> float | tuple:
        return self.sample_fn(doc, response)

    def aggregate(self, values: list) -> float:
        """Corpus value; NaN for an empty corpus rather than a ZeroDivisionError deep inside corpus_fn."""
        values = list(values)
        return float(self.corpus_fn(values)) if values else math.nan

    def stderr(self, values: list) -> float:
        """Standard error of `aggregate`: analytic for the mean, bootstrapped otherwise; NaN below 2 documents."""
        values = list(values)
        if len(values) < 2:
            return math.nan
        if self.corpus_fn is mean:
            return mean_stderr(values)
        return bootstrap_stderr(self.corpus_fn, values)
