"""All metrics by name, plus pass@K / maj@K built on demand for any K."""

from __future__ import annotations

import difflib
import functools
import re

from nano_eval.metrics import generative as gen
from nano_eval.metrics import loglikelihood as ll
from nano_eval.metrics.metric import Metric, mean
from nano_eval.tasks.requests import RequestType

_LL, _ROLLING, _GEN = RequestType.LOGLIKELIHOOD, RequestType.LOGLIKELIHOOD_ROLLING, RequestType.GREEDY_UNTIL
_SAMPLING = re.compile(r"^(pass|maj)@(\d+)$")

_ALL = [
    Metric(name="acc", request_type=_LL, sample_fn=ll.acc, corpus_fn=mean),
    Metric(name="acc_norm", request_type=_LL, sample_fn=ll.acc_norm, corpus_fn=mean),
    Metric(name="acc_norm_token", request_type=_LL, sample_fn=ll.acc_norm_token, corpus_fn=mean),
    Metric(name="acc_golds_likelihood", request_type=_LL, sample_fn=ll.acc_golds_likelihood, corpus_fn=mean),
    Metric(name="acc_norm_pmi", request_type=_LL, sample_fn=ll.acc_norm_pmi, corpus_fn=mean, needs_unconditioned=True),
    Metric(name="prob_gold", request_type=_LL, sample_fn=ll.prob_gold, corpus_fn=mean),
    Metric(name="prob_norm_gold", request_type=_LL, sample_fn=ll.prob_norm_gold, corpus_fn=mean),
    Metric(
        name="bits_per_byte_gold",
        request_type=_LL,
        sample_fn=ll.bits_per_byte_gold,
        corpus_fn=mean,
        higher_is_better=False,
    ),
    Metric(
        name="target_perplexity",
        request_type=_LL,
        sample_fn=ll.target_perplexity_sample,
        corpus_fn=ll.weighted_perplexity,
        higher_is_better=False,
    ),
    Metric(
        name="word_perplexity",
        request_type=_ROLLING,
        sample_fn=ll.rolling_words,
        corpus_fn=ll.weighted_perplexity,
        higher_is_better=False,
    ),
    Metric(
        name="byte_perplexity",
        request_type=_ROLLING,
        sample_fn=ll.rolling_bytes,
        corpus_fn=ll.weighted_perplexity,
        higher_is_better=False,
    ),
    Metric(
        name="bits_per_byte",
        request_type=_ROLLING,
        sample_fn=ll.rolling_bytes,
        corpus_fn=ll.weighted_bits_per_byte,
        higher_is_better=False,
    ),
    Metric(name="exact_match", request_type=_GEN, sample_fn=gen.exact_match, corpus_fn=mean),
    Metric(name="quasi_exact_match", request_type=_GEN, sample_fn=gen.quasi_exact_match, corpus_fn=mean),
    Metric(name="gsm8k_match", request_type=_GEN, sample_fn=gen.gsm8k_match, corpus_fn=mean),
]

METRICS: dict[str, Metric] = {m.name: m for m in _ALL}


@functools.cache
def _sampling_metric(kind: str, k: int) -> Metric:
    """pass@k / maj@k; cached so that asking twice for the same name gives the same (equal) Metric."""
    fn = gen.pass_at_k if kind == "pass" else gen.maj_at_k
    return Metric(
        name=f"{kind}@{k}",
        request_type=_GEN,
        sample_fn=functools.partial(fn, k),
        corpus_fn=mean,
        num_samples=k,
    )


def get_metric(name_or_metric: str | Metric) -> Metric:
    """Look a metric up by name (Metric objects pass through); unknown names fail with the closest spellings."""
    if isinstance(name_or_metric, Metric):
        return name_or_metric
    name = name_or_metric
    if name in METRICS:
        return METRICS[name]
    sampling = _SAMPLING.match(name)
    if sampling and int(sampling.group(2)) >= 1:
        return _sampling_metric(sampling.group(1), int(sampling.group(2)))
    close = difflib.get_close_matches(name, [*METRICS, "pass@k", "maj@k"], n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    raise ValueError(
        f"unknown metric {name!r}; {hint}All names: `python -c \"from nano_eval.metrics import METRICS; "
        f"print(sorted(METRICS))\"`, plus pass@K and maj@K for any K >= 1."
    )
