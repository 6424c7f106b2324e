"""What a sweep row's metric name says about its values: which way is better, and whether it is bounded to [0, 1].

A sweep table (table.py) keeps only metric names, not the Metric objects, so the direction is known here by name,
in one place. The names with higher_is_better=False in nano_eval.metrics.registry and nano_eval.metrics.lighteval
are listed (tests/test_sweep_signal.py checks the list covers the registry), plus any name containing
"perplexity", "bits_per_byte" or "loss".
"""

from __future__ import annotations

import re

LOWER_IS_BETTER = frozenset({"bits_per_byte", "bits_per_byte_gold", "target_perplexity", "word_perplexity",
                             "byte_perplexity", "perplexity", "ppl", "ter", "edit_distance"})
_LOWER_PARTS = ("perplexity", "bits_per_byte", "loss")

# Fractions by definition: accuracies, probabilities, exact match, F1, pass@k / maj@k (lighteval's names too).
_BOUNDED = re.compile(r"^(acc|prob|normalized_mc_prob|exact_match|quasi_exact_match|em|f1|gsm8k_match|pass@|maj@"
                      r"|avg@|mrr|recall|precision|rouge|edit_similarity)")


def lower_is_better(metric: str) -> bool:
    """True when a smaller value of `metric` (a sweep row's metric name) is better."""
    return metric in LOWER_IS_BETTER or any(part in metric for part in _LOWER_PARTS)


def bounded(metric: str) -> bool:
    """True when `metric` lies in [0, 1] by definition (accuracies, probabilities, em, f1, pass@k ...)."""
    return bool(_BOUNDED.match(metric)) and not lower_is_better(metric)
