"""The nanotron backend in every TP x PP x DP layout equals the single-process reference.

The model is built from nanotron's real parallel modules (TensorParallelEmbedding, column/row linears,
PipelineBlock + P2P + TensorPointer, vocab-parallel LM head) on real gloo process groups; see nano_eval/toy_nanotron.py.
"""

import pytest

pytest.importorskip("nanotron")

from tests.dist_utils import run_distributed  # noqa: E402
from tests.nanotron_worker import evaluate_layout  # noqa: E402

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|0"
EXACT = ("acc", "acc_norm", "acc_norm_token", "acc_norm_pmi", "exact_match", "quasi_exact_match")


def _evaluate(rank, world, tp, pp, dp, tokenizer_dir, batch_tokens):
    return evaluate_layout(rank, world, tp, pp, dp, tokenizer_dir, TASKS, batch_tokens=batch_tokens, max_samples=12)


@pytest.fixture(scope="module")
def reference(toy_checkpoint):
    return run_distributed(_evaluate, 1, 1, 1, 1, str(toy_checkpoint), 100_000)[0]


@pytest.mark.parametrize("tp, pp, dp", [(1, 1, 2), (2, 1, 1), (1, 2, 1), (2, 2, 1), (2, 2, 2)])
def test_layout_matches_single_process(reference, toy_checkpoint, tp, pp, dp):
    per_rank = run_distributed(_evaluate, tp * pp * dp, tp, pp, dp, str(toy_checkpoint), 96)
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
