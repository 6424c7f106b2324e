"""bf16 scores against fp32 scores of the same weights, for every backend's bf16 test.

The tolerance is stated once, here, and is set by bf16 itself: 8 significant bits (relative rounding 2^-9 per
operation), through a few layers and a vocabulary log-softmax taken in fp32. Measured on the tests' toy models:
per-request log-probs within 1.2 % relative of fp32 (Megatron tp2, transformers, nanotron alike); perplexity totals
over hundreds of tokens within 0.1 %.
"""

from __future__ import annotations

REL = 0.02  # |bf16 - fp32| <= REL x max(1, |fp32|) per request log-prob, and per continuous metric
CONTINUOUS = ("prob_norm_gold", "bits_per_byte_gold", "word_perplexity", "byte_perplexity", "bits_per_byte")


def assert_bf16_close(fp32: dict, bf16: dict, what: str) -> None:
    """fp32 / bf16: tests/nanotron_worker.py's summarize() of the same tasks. Log-probs within REL; continuous
    metrics within REL relative; every document's best choice by log-prob the same, unless its two best choices are
    within 2 x REL of each other in fp32 (a near-tie bf16 may break either way); accuracy metrics within those
    documents plus one (a normalised accuracy may also meet a near-tie of its own normalised scores)."""
    assert set(bf16) == set(fp32), what
    for task, ref in fp32.items():
        got = bf16[task]
        near_ties = 0
        for doc, (a, b) in enumerate(zip(ref["logprobs"], got["logprobs"], strict=True)):
            for x, y in zip(a, b, strict=True):
                assert abs(x - y) <= REL * max(1.0, abs(x)), f"{what} {task} document {doc}: {y} in bf16, {x} in fp32"
            if len(a) > 1:
                best = sorted(range(len(a)), key=lambda i: -a[i])
                tie = a[best[0]] - a[best[1]] < 2 * REL * max(1.0, abs(a[best[0]]))
                near_ties += tie
                assert tie or max(range(len(b)), key=lambda i: b[i]) == best[0], f"{what} {task} document {doc}"
        n = len(ref["logprobs"])
        for name, value in ref["metrics"].items():
            if name in CONTINUOUS:
                assert abs(got["metrics"][name] - value) <= REL * abs(value), (what, task, name)
            elif name.startswith("acc"):
                assert abs(got["metrics"][name] - value) <= (near_ties + 1) / n + 1e-12, (what, task, name)
