"""Hand-computed and lm-eval-parity checks for nano_eval.metrics (no model needed)."""

import dataclasses
import itertools
import math

import numpy as np
import pytest

from nano_eval.metrics import METRICS, Metric, get_metric
from nano_eval.metrics.generative import extract_number, normalize_text
from nano_eval.metrics.loglikelihood import acc
from nano_eval.response import ModelResponse
from nano_eval.tasks.requests import Doc, RequestType


def mc(choices, gold, logprobs, **response_kwargs):
    return Doc(query="Q:", choices=choices, gold_index=gold), ModelResponse(logprobs=logprobs, **response_kwargs)


def score(name, doc, response):
    return get_metric(name).compute(doc, response)


def gen(golds, predictions):
    return Doc(query="Q:", choices=golds, gold_index=list(range(len(golds)))), ModelResponse(text=predictions)


# --- multiple-choice accuracies ---


@pytest.mark.parametrize(
    "logprobs, gold, expected",
    [
        ([-1.0, -2.0, -3.0], 0, 1.0),
        ([-1.0, -2.0, -3.0], 1, 0.0),
        ([-1.0, -1.0, -3.0], 0, 1.0),  # tie: first index wins
        ([-1.0, -1.0, -3.0], 1, 0.0),
        ([-3.0, -2.0, -1.0], [1, 2], 1.0),  # several golds
        ([-3.0, -2.0, -1.0], [0, 1], 0.0),
    ],
)
def test_acc(logprobs, gold, expected):
    assert score("acc", *mc(["a", "b", "c"], gold, logprobs)) == expected


def test_acc_norm_flips_acc_because_of_length():
    doc, resp = mc([" a", " bbbbbbbbb"], 1, [-2.0, -5.0])  # per char: -1.0 vs -0.5
    assert score("acc", doc, resp) == 0.0
    assert score("acc_norm", doc, resp) == 1.0


def test_acc_norm_does_not_count_the_leading_space():
    # Without its separator space " cat" is 3 characters: -1.33 per char vs "dogs" -1.1 per char picks choice 1.
    # Counting the space (4 characters, -1.0) would pick choice 0; lm-eval does not count it.
    doc, resp = mc([" cat", "dogs"], 1, [-4.0, -4.4])
    assert score("acc_norm", doc, resp) == 1.0


def test_acc_norm_matches_lm_eval_formula():
    rng = np.random.default_rng(0)
    choices = [" yes", " no", " maybe so", " é"]
    for _ in range(50):
        lls = rng.normal(-5, 2, size=4).tolist()
        gold = int(rng.integers(4))
        lengths = [float(len(c[1:])) for c in choices]  # lm-eval: choice text without the target_delimiter space
        expected = 1.0 if np.argmax(np.array(lls) / np.array(lengths)) == gold else 0.0
        assert score("acc_norm", *mc(choices, gold, lls)) == expected


def test_acc_norm_token():
    doc, resp = mc([" a", " b"], 1, [-2.0, -5.0], continuation_token_counts=[1, 4])  # -2 vs -1.25
    assert score("acc", doc, resp) == 0.0
    assert score("acc_norm_token", doc, resp) == 1.0


def test_acc_norm_pmi_flips_acc():
    doc, resp = mc([" a", " b"], 1, [-1.0, -2.0], unconditioned_logprobs=[-0.5, -3.0])  # -0.5 vs +1.0
    assert score("acc", doc, resp) == 0.0
    assert score("acc_norm_pmi", doc, resp) == 1.0
    assert get_metric("acc_norm_pmi").needs_unconditioned
    assert not get_metric("acc").needs_unconditioned


def test_acc_norm_pmi_without_unconditioned_logprobs_raises():
    with pytest.raises(ValueError, match="unconditioned"):
        score("acc_norm_pmi", *mc([" a", " b"], 0, [-1.0, -2.0]))


# --- gold probabilities ---


def test_prob_gold_uses_best_gold():
    lls = [math.log(0.5), math.log(0.2), math.log(0.1)]
    assert score("prob_gold", *mc(["a", "b", "c"], 1, lls)) == pytest.approx(0.2)
    assert score("prob_gold", *mc(["a", "b", "c"], [2, 0], lls)) == pytest.approx(0.5)


def test_prob_norm_gold():
    lls = [math.log(0.4), math.log(0.2), math.log(0.2)]  # renormalised: 0.5, 0.25, 0.25
    assert score("prob_norm_gold", *mc(["a", "b", "c"], 1, lls)) == pytest.approx(0.25)
    assert score("prob_norm_gold", *mc(["a", "b", "c"], [1, 2], lls)) == pytest.approx(0.5)
    big = [-1000.0, -1001.0]  # stable for very negative log-probs
    assert score("prob_norm_gold", *mc(["a", "b"], 0, big)) == pytest.approx(1 / (1 + math.exp(-1)))


def test_bits_per_byte_gold():
    doc, resp = mc([" é", "x"], 0, [-3.0, -0.1])  # " é" is 3 UTF-8 bytes
    assert score("bits_per_byte_gold", doc, resp) == pytest.approx(1 / math.log(2))
    assert not get_metric("bits_per_byte_gold").higher_is_better


def test_target_perplexity():
    m = get_metric("target_perplexity")
    values = [m.compute(*mc([" hello world", "x"], 0, [-4.0, -1.0])), m.compute(*mc(["y", " hi"], 1, [-0.1, -2.0]))]
    assert values == [(-4.0, 2), (-2.0, 1)]
    assert m.aggregate(values) == pytest.approx(math.exp(6 / 3))
    assert not m.higher_is_better


# --- rolling perplexities vs lm-eval ---

TEXTS = ["The cat sat on the mat.", " Leading space and\n\nnewlines here ", "Ünïcödé wörds — 3 of them?", "x"]
LOGPROBS = [-30.5, -55.25, -80.0, -4.0]


def test_rolling_perplexities_match_lm_eval():
    lm_metrics = pytest.importorskip("lm_eval.api.metrics")
    from lm_eval.api.task import Task

    docs = [Doc(query=t) for t in TEXTS]
    resps = [ModelResponse(logprobs=[lp]) for lp in LOGPROBS]
    words = [(lp, Task.count_words(t)) for t, lp in zip(TEXTS, LOGPROBS)]
    nbytes = [(lp, Task.count_bytes(t)) for t, lp in zip(TEXTS, LOGPROBS)]
    expected = {
        "word_perplexity": lm_metrics.weighted_perplexity(words),
        "byte_perplexity": lm_metrics.weighted_perplexity(nbytes),
        "bits_per_byte": lm_metrics.bits_per_byte(nbytes),
    }
    for name, want in expected.items():
        m = get_metric(name)
        assert m.request_type == RequestType.LOGLIKELIHOOD_ROLLING
        assert not m.higher_is_better
        values = [m.compute(d, r) for d, r in zip(docs, resps)]
        assert values == (words if name == "word_perplexity" else nbytes)
        assert m.aggregate(values) == pytest.approx(want, rel=1e-12)


def test_corpus_weighting_is_not_mean_of_documents():
    m = get_metric("byte_perplexity")
    values = [(-10.0, 10), (-1.0, 100)]
    assert m.aggregate(values) == pytest.approx(math.exp(11 / 110))
    assert get_metric("bits_per_byte").aggregate(values) == pytest.approx(11 / 110 / math.log(2))


# --- standard errors ---


def test_mean_stderr_matches_lm_eval():
    lm_metrics = pytest.importorskip("lm_eval.api.metrics")
    values = [1.0, 0.0, 1.0, 1.0, 0.0, 0.25, 0.5]
    assert get_metric("acc").stderr(values) == pytest.approx(lm_metrics.mean_stderr(values), rel=1e-12)


def test_stderr_nan_below_two_documents():
    assert math.isnan(get_metric("acc").stderr([])) and math.isnan(get_metric("word_perplexity").stderr([]))
    assert math.isnan(get_metric("acc").stderr([1.0])) and math.isnan(get_metric("acc").aggregate([]))
    assert math.isnan(get_metric("word_perplexity").stderr([(-3.0, 2)]))


def test_bootstrap_stderr_deterministic_and_finite():
    m = get_metric("word_perplexity")
    rng = np.random.default_rng(7)
    values = [(float(-rng.uniform(5, 50)), int(rng.integers(5, 20))) for _ in range(40)]
    first, second = m.stderr(values), m.stderr(values)
    assert first == second
    assert math.isfinite(first) and first > 0
    assert m.stderr([(-3.0, 2)] * 5) == pytest.approx(0.0, abs=1e-12)  # identical documents: no spread


def test_bootstrap_used_for_custom_corpus_fn():
    m = Metric(name="median", request_type=RequestType.LOGLIKELIHOOD, sample_fn=acc, corpus_fn=np.median)
    s = m.stderr([float(i) for i in range(30)])
    assert math.isfinite(s) and s > 0 and s == m.stderr([float(i) for i in range(30)])


# --- generative ---


def test_exact_and_quasi_exact_match():
    doc, resp = gen(["Paris", "paris city"], [" Paris\n", "London"])
    assert score("exact_match", doc, resp) == 1.0
    doc, resp = gen(["Paris"], ["The Paris!"])
    assert score("exact_match", doc, resp) == 0.0
    assert score("quasi_exact_match", doc, resp) == 1.0
    assert score("quasi_exact_match", *gen(["Paris"], ["Paris, France"])) == 0.0
    assert score("exact_match", *gen(["Paris"], [])) == 0.0


def test_quasi_exact_match_uses_post_processed_text():
    doc = Doc(query="Q:", choices=["42"], gold_index=0)
    resp = ModelResponse(text=["<think>hmm 41?</think> 42"]).post_process()
    assert score("exact_match", doc, resp) == 1.0


def test_normalize_text():
    assert normalize_text("  The  Quick, brown fox;  a DOG an apple! ") == "quick brown fox dog apple"
    assert normalize_text("theater") == "theater"  # articles only as whole words


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is $1,234.", 1234.0),
        ("#### 72", 72.0),
        ("so 3.5 apples", 3.5),
        ("She has 5 + 3 = 8 pens.\n#### 8", 8.0),
        ("12 minus 4 is 8. The answer is 8. Next she buys 20", 8.0),
        ("the answer is -5 degrees", -5.0),
        ("It costs -$3.50 now", -3.5),
        ("First 10, then 20, finally 1,000,000.", 1_000_000.0),
        ("no number here", None),
    ],
)
def test_extract_number(text, expected):
    assert extract_number(text) == expected


def test_gsm8k_match():
    gold = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert score("gsm8k_match", *gen([gold], ["48 + 24 = 72. The answer is 72."])) == 1.0
    assert score("gsm8k_match", *gen([gold], ["#### 72.0000000001"])) == 1.0
    assert score("gsm8k_match", *gen([gold], ["#### 72.01"])) == 0.0
    assert score("gsm8k_match", *gen([gold], ["I don't know"])) == 0.0


def brute_force_pass_at_k(correct: list[bool], k: int) -> float:
    subsets = list(itertools.combinations(range(len(correct)), k))
    return sum(any(correct[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_pass_at_k_matches_brute_force(k):
    preds = ["Paris", "london", "The paris.", "Rome", "Berlin", "paris"]
    correct = [normalize_text(p) == "paris" for p in preds]
    m = get_metric(f"pass@{k}")
    assert m.num_samples == k and m.name == f"pass@{k}"
    assert m.compute(*gen(["Paris"], preds)) == pytest.approx(brute_force_pass_at_k(correct, k))


def test_pass_at_k_numeric_for_gsm8k_golds():
    preds = ["The answer is 72.", "#### 71", "so 72 clips", "72.0", "I think 70"]
    correct = [True, False, True, True, False]
    want = brute_force_pass_at_k(correct, 2)
    assert get_metric("pass@2").compute(*gen(["... #### 72"], preds)) == pytest.approx(want)


def test_sampling_metrics_need_enough_predictions():
    for name in ("pass@4", "maj@4"):
        with pytest.raises(ValueError, match=rf"{name}.*num_samples"):
            get_metric(name).compute(*gen(["a"], ["a", "a"]))


def test_maj_at_k():
    gsm = ["The answer is 5", "#### 7", "so 7 apples", "5", "5"]
    assert get_metric("maj@1").compute(*gen(["#### 7"], gsm)) == 0.0
    assert get_metric("maj@3").compute(*gen(["#### 7"], gsm)) == 1.0
    assert get_metric("maj@5").compute(*gen(["#### 7"], gsm)) == 0.0  # 5 wins 3 to 2
    text = ["London", "Paris", "the paris!", "London"]
    assert get_metric("maj@3").compute(*gen(["Paris"], text)) == 1.0
    assert get_metric("maj@4").compute(*gen(["Paris"], text)) == 0.0  # 2-2 tie: first seen (London) wins
    no_answers = ["no idea", "none", "7"]
    assert get_metric("maj@2").compute(*gen(["#### 7"], no_answers)) == 0.0
    assert get_metric("maj@3").compute(*gen(["#### 7"], no_answers)) == 1.0  # answerless samples don't vote
    assert get_metric("maj@8").num_samples == 8


# --- registry ---


def test_registry():
    assert all(name == m.name for name, m in METRICS.items())
    assert get_metric("acc") is METRICS["acc"]
    custom = Metric(name="x", request_type=RequestType.GREEDY_UNTIL, sample_fn=lambda d, r: 1.0, corpus_fn=sum)
    assert get_metric(custom) is custom
    assert get_metric("pass@4") == get_metric("pass@4")
    assert "pass@4" not in METRICS
    assert METRICS["acc"].num_samples == 1 and get_metric("exact_match").request_type == RequestType.GREEDY_UNTIL
    assert get_metric("acc").request_type == RequestType.LOGLIKELIHOOD
    with pytest.raises(dataclasses.FrozenInstanceError):
        METRICS["acc"].name = "other"


def test_unknown_metric_names_close_match():
    with pytest.raises(ValueError, match="acc_norm") as err:
        get_metric("accnorm")
    assert "METRICS" in str(err.value)
    with pytest.raises(ValueError, match="pass@k"):
        get_metric("pass@0")
    with pytest.raises(ValueError, match="unknown metric"):
        get_metric("zzzzzzzz")


def test_acc_golds_likelihood_is_greedy_match_of_a_gold():
    doc, resp = mc([" a", " b"], 1, [-1.0, -2.0], argmax_logits_eq_gold=[True, False])
    assert score("acc_golds_likelihood", doc, resp) == 0.0
    doc, resp = mc([" a", " b"], [0, 1], [-1.0, -2.0], argmax_logits_eq_gold=[True, False])
    assert score("acc_golds_likelihood", doc, resp) == 1.0
