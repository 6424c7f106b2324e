"""Packed rows against one row per request, on any backend in any layout (run inside each rank of a world).

The requests hold every shape packing produces: documents with several multi-token continuations (a tree), short
documents several to a row, documents that share a few-shot prefix, single-token choices (one plain row), and
PMI-style requests whose context differs from their document's. `packed_vs_unpacked(backend)` scores them twice
through the engine, packed (nano_eval's defaults) and with `packing=False`, and returns what a test compares:
per-request log-probs, greedy flags, and the work of each run (token positions given to the model, padding, and
positions projected through the output layer when `output_layer_rows` is given).
"""

from __future__ import annotations

CONTEXTS = ["Question: 3 plus 4\nAnswer:", "The dog runs ", "", "a b c d e f g h i j k", "one two three " * 6]
CHOICES = [" 7", "to the house.", " blue", " the cat sat on the mat and", " 8"]
FEWSHOT = "Question: 1 plus 1\nAnswer: 2\n\nQuestion: 2 plus 5\nAnswer: 7\n\nQuestion: 4 plus 4\nAnswer: 8\n\n"
QUESTIONS = [f"Question: {a} plus {b}\nAnswer:" for a, b in [(3, 4), (1, 6), (5, 3), (2, 2), (9, 1), (0, 7)]]


def requests(contexts=CONTEXTS, choices=CHOICES, unconditioned=True, task="t"):
    """Every context with every choice, plus PMI-style requests (a different, shared context) for document 0 and
    single-token letter choices for three documents."""
    from nano_eval.tasks.requests import LoglikelihoodRequest

    reqs = [LoglikelihoodRequest(task, i, j, c, choice=ch)
            for i, c in enumerate(contexts) for j, ch in enumerate(choices)]
    if unconditioned:
        reqs += [LoglikelihoodRequest(task, 0, len(choices) + j, "Answer:", choice=ch) for j, ch in enumerate(choices)]
    reqs += [LoglikelihoodRequest(f"{task}-letters", i, j, c + " Answer:", choice=ch)  # all single-token choices
             for i, c in enumerate(contexts[:3]) for j, ch in enumerate([" 7", " 8", " 1", " blue"])]
    return reqs


def fewshot_requests():
    """Documents that share FEWSHOT (a prefix packing stores once per row), with tree-shaped continuations."""
    return requests([FEWSHOT + q for q in QUESTIONS] + [FEWSHOT], [" 7", " 8", " the cat sat", " 1"],
                    unconditioned=False, task="fewshot")


def all_requests():
    return requests() + fewshot_requests()


def score(backend, reqs, **batching) -> tuple[dict, dict]:
    """({request key: (log-prob, greedy, tokens)}, work) of one engine run over `reqs` (fresh request objects)."""
    from nano_eval.backends.base import evaluation_mode
    from nano_eval.engine import BatchingConfig, Engine

    engine = Engine(backend, BatchingConfig(shared_prefix_tokens=16, **batching), progress=False)
    dataset = engine.prepare_loglikelihood(reqs)
    with evaluation_mode(backend.module):
        results = engine.run_loglikelihood(dataset)
    out = {repr(k): (r.logprob, r.is_greedy, r.num_tokens) for k, r in results.items()}
    work = dict(engine.work)
    work["masked_rows"] = sum(r.needs_mask for r in dataset.items)
    return out, work


def packed_vs_unpacked(backend, output_layer_rows=None, **batching) -> dict:
    """Both runs' results and work, and the largest log-prob difference / greedy mismatches between them.
    `output_layer_rows`: a callable returning the rows the output layer has projected so far on this rank."""
    def run(**options):
        before = output_layer_rows() if output_layer_rows else 0
        results, work = score(backend, all_requests(), **batching, **options)
        if output_layer_rows:
            work["output_layer_rows_here"] = output_layer_rows() - before
        return results, work

    unpacked, unpacked_work = run(packing=False)
    packed, packed_work = run()
    assert packed.keys() == unpacked.keys()
    return {"max_diff": max(abs(packed[k][0] - unpacked[k][0]) for k in packed),
            # |packed - unpacked| <= 1e-5 + 1e-6 |unpacked| (torch.isclose): for kernels that differ between the
            # two paths (megatron-core: torch's fused SDPA packed, megatron's eager attention unpacked), whose fp32
            # sums of a continuation's log-probs (tens of nats) differ by a few ulps
            "within_1e-5_plus_1e-6_relative": all(abs(packed[k][0] - unpacked[k][0]) <= 1e-5 + 1e-6 * abs(unpacked[k][0])
                                                 for k in packed),
            "greedy_mismatches": [k for k in packed if packed[k][1:] != unpacked[k][1:]],
            "packed": packed_work, "unpacked": unpacked_work, "requests": len(packed)}


def assert_packing_exact(per_rank: list, what: str, fewer: float = 3):
    """tests/packing_checks.py on every rank: packed rows (a document's context once under nano_eval's tree mask
    and per-token RoPE positions, several documents per row, a shared few-shot prefix once) give the log-probs of
    one row per request within 1e-5 and the same greedy flags; far fewer token positions; lm_head projected each
    distinct scored position once, on the last stage only."""
    for check in per_rank:
        assert check["max_diff"] <= 1e-5 and not check["greedy_mismatches"], (what, check)
        packed, unpacked = check["packed"], check["unpacked"]
        assert packed["masked_rows"] > 0 and packed["positions"] < unpacked["positions"] / fewer, (what, check)
        for work in (packed, unpacked):  # REDUCE_SCATTER at tp2: up to one padding row per forward
            rows = work["output_layer_rows_here"]
            assert rows == 0 or 0 <= rows - work["output_positions"] <= work["forwards"], (what, check)
    assert any(c["packed"]["output_layer_rows_here"] for c in per_rank), what
