"""The nanotron backend in every TP x PP x DP layout equals the single-process reference.

The model is built from nanotron's real parallel modules (TensorParallelEmbedding, column/row linears,
PipelineBlock + P2P + TensorPointer, vocab-parallel LM head) on real gloo process groups; see tests/toy_nanotron.py.
"""

import pytest

pytest.importorskip("nanotron")

from tests.dist_utils import run_distributed  # noqa: E402
from tests.nanotron_worker import evaluate_layout  # noqa: E402

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|0"
EXACT = ("acc", "acc_norm", "acc_norm_token", "acc_norm_pmi", "exact_match", "quasi_exact_match")


def _evaluate(rank, world, tp, pp, dp, tokenizer_dir, batch_tokens, qwen_style=False):
    return evaluate_layout(rank, world, tp, pp, dp, tokenizer_dir, TASKS, batch_tokens=batch_tokens, max_samples=12,
                           qwen_style=qwen_style)


@pytest.fixture(scope="module")
def reference(toy_checkpoint):
    return run_distributed(_evaluate, 1, 1, 1, 1, str(toy_checkpoint), 100_000)[0]


@pytest.mark.parametrize(
    "tp, pp, dp, qwen_style",
    [(1, 1, 2, False), (2, 1, 1, False), (1, 2, 1, False), (2, 2, 1, False), (2, 2, 2, False), (2, 2, 1, True)],
    ids=["dp2", "tp2", "pp2", "tp2xpp2", "dp2xtp2xpp2", "tp2xpp2-position_ids"],
)
def test_layout_matches_single_process(reference, toy_checkpoint, tp, pp, dp, qwen_style):
    """qwen_style: the model takes (input_ids, position_ids) like nanotron main's Qwen2 instead of input_mask."""
    per_rank = run_distributed(_evaluate, tp * pp * dp, tp, pp, dp, str(toy_checkpoint), 96, qwen_style)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the results"
    got = per_rank[0]
    for key, ref in reference.items():
        for name, value in ref["metrics"].items():
            if name in EXACT:
                assert got[key]["metrics"][name] == value, (key, name)
            else:
                assert got[key]["metrics"][name] == pytest.approx(value, rel=1e-6), (key, name)
        for a, b in zip(ref["logprobs"], got[key]["logprobs"], strict=True):
            if key.startswith("demo|arithmetic_ppl"):  # a document's total over hundreds of tokens
                assert b == pytest.approx(a, rel=1e-7)
            else:
                assert b == pytest.approx(a, abs=1e-5)
        assert got[key]["predictions"] == ref["predictions"]


def _peak(rank, world, tp, tokenizer_dir):
    from tests.nanotron_worker import peak_scoring_memory_mb

    return peak_scoring_memory_mb(rank, world, tp, 65536, tokenizer_dir)


def test_peak_scoring_memory_follows_vocab_over_tp(toy_checkpoint):
    """Logits for 8 x 255 positions over a 65536-token vocabulary: about 512 MiB in fp32 at TP1. Each TP rank
    must hold only its V/tp slice; gathering the full vocabulary would keep the peak at the TP1 level."""
    tp1 = run_distributed(_peak, 1, 1, str(toy_checkpoint))[0]
    tp2 = max(run_distributed(_peak, 2, 2, str(toy_checkpoint)))
    assert tp1 > 400
    assert tp2 < 0.65 * tp1, f"peak rise per rank: TP1 {tp1:.0f} MiB, TP2 {tp2:.0f} MiB"


def _failing(rank, world, tokenizer_dir):
    from tests.nanotron_worker import evaluate_with_failing_rank

    return evaluate_with_failing_rank(rank, world, tokenizer_dir)


def test_a_rank_that_raises_mid_evaluation_stops_its_peers_in_bounded_time(toy_checkpoint):
    """Rank 1 raises between TP collectives; rank 0, waiting in a TP all-reduce for it, must fail too (the peer's
    connection closes, or the process-group timeout fires) instead of hanging."""
    (outcome0, t0), (outcome1, t1) = run_distributed(_failing, 2, str(toy_checkpoint), pg_timeout_s=20, timeout=120)
    assert outcome1 == "RuntimeError: injected failure"
    assert outcome0 != "finished" and t0 < 60, (outcome0, t0)
