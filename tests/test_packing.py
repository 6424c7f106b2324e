"""Shared-prefix and multi-document packing give the scores of one row per request (real toy Llama, sdpa + eager)."""

import pytest
import torch

from nano_eval.backends.transformers import TransformersModel
from nano_eval.engine import BatchingConfig, Engine
from nano_eval.rows import PAD, PREFIX, Choice, Row, Segment, last_position_row, make_batch, tree_attention_mask
from nano_eval.tasks.requests import LoglikelihoodRequest

CONTEXTS = ["Question: 3 plus 4\nAnswer:", "The dog runs ", "", "a b c d e f g h i j k", "one two three " * 6]
CHOICES = [" 7", "to the house.", " blue", " the cat sat on the mat and", " 8"]


def _requests(contexts=CONTEXTS, choices=CHOICES, unconditioned=True):
    """Every context with every choice, plus PMI-style requests (a different, shared context) for document 0."""
    reqs = [LoglikelihoodRequest("t", i, j, c, choice=ch)
            for i, c in enumerate(contexts) for j, ch in enumerate(choices)]
    if unconditioned:
        reqs += [LoglikelihoodRequest("t", 0, len(choices) + j, "Answer:", choice=ch) for j, ch in enumerate(choices)]
    reqs += [LoglikelihoodRequest("letters", i, j, c + " Answer:", choice=ch)  # all single-token choices
             for i, c in enumerate(contexts[:3]) for j, ch in enumerate([" 7", " 8", " 1", " blue"])]
    return reqs


def _run(backend, requests, **batching):
    engine = Engine(backend, BatchingConfig(**batching), progress=False)
    dataset = engine.prepare_loglikelihood(requests)
    return engine.run_loglikelihood(dataset), dataset


def _assert_same(got: dict, ref: dict, tol=1e-5):
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].logprob == pytest.approx(ref[k].logprob, abs=tol), k
        assert (got[k].is_greedy, got[k].num_tokens, got[k].truncated) == (
            ref[k].is_greedy, ref[k].num_tokens, ref[k].truncated), k


@pytest.fixture(scope="module")
def eager_backend(toy_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(toy_checkpoint), attn_implementation="eager")
    return TransformersModel(model, AutoTokenizer.from_pretrained(str(toy_checkpoint)))


def test_tree_mask_semantics():
    # one row: doc 0 = context (2 tokens), choice 1 (2 tokens), choice 2 (1 token); doc 1 = 2 tokens; 1 pad
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, -1]])
    br = torch.tensor([[0, 0, 1, 1, 2, 0, 0, 0]])
    m = tree_attention_mask(seg, br)[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0],  # choice 2 sees the context and itself, not choice 1
        [0, 0, 0, 0, 0, 1, 0, 0],  # doc 1 sees nothing of doc 0
        [0, 0, 0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 1],  # padding attends itself only: no fully masked row
    ]


def test_tree_mask_with_shared_prefix():
    # prefix (2 tokens), doc 0 = 1 context token + one 1-token branch, doc 1 = 1 context token, padding
    seg = torch.tensor([[PREFIX, PREFIX, 0, 0, 1, PAD]])
    br = torch.tensor([[0, 0, 0, 1, 0, 0]])
    m = tree_attention_mask(seg, br)[0, 0].int().tolist()
    assert m == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # doc 1 sees the shared prefix, not doc 0
        [0, 0, 0, 0, 0, 1],
    ]


FEWSHOT = "Question: 1 plus 1\nAnswer: 2\n\nQuestion: 2 plus 5\nAnswer: 7\n\nQuestion: 4 plus 4\nAnswer: 8\n\n"


@pytest.mark.parametrize("row_tokens", [60, 2048])
def test_shared_prefix_rows_equal_unpacked(toy_backend, row_tokens):
    """Documents with the same few-shot examples: the examples run once per row (MMLU-style), same scores."""
    questions = [f"Question: {a} plus {b}\nAnswer:" for a, b in [(3, 4), (1, 6), (5, 3), (2, 2), (9, 1), (0, 7)]]
    contexts = [FEWSHOT + q for q in questions] + [FEWSHOT]
    requests = _requests(contexts, [" 7", " 8", " the cat sat", " 1"], unconditioned=False)
    ref, _ = _run(toy_backend, requests, packing=False)
    got, packed = _run(toy_backend, requests, shared_prefix_row_tokens=row_tokens, shared_prefix_tokens=16)
    _assert_same(got, ref)
    shared = [r for r in packed.items if r.prefix]
    assert shared and all(len(r.segments) > 1 and r.input_len <= row_tokens for r in shared)
    _, unshared = _run(toy_backend, requests, shared_prefix_tokens=0)
    assert sum(r.input_len for r in packed.items) < sum(r.input_len for r in unshared.items)


@pytest.mark.parametrize("backend_name", ["toy_backend", "eager_backend"])
def test_packed_equals_unpacked(request, backend_name):
    backend = request.getfixturevalue(backend_name)
    ref, flat = _run(backend, _requests(), packing=False)
    got, packed = _run(backend, _requests())
    _assert_same(got, ref)
    assert sum(r.length for r in packed.items) < sum(r.length for r in flat.items)  # the contexts ran once
    assert any(r.needs_mask for r in packed.items)


@pytest.mark.parametrize("pack_tokens,budget", [(64, 100_000), (256, 300), (10_000, 100_000)])
def test_multi_document_rows_equal_unpacked(toy_backend, pack_tokens, budget):
    ref, _ = _run(toy_backend, _requests(), packing=False)
    got, packed = _run(toy_backend, _requests(), pack_tokens=pack_tokens, max_batch_tokens=budget)
    _assert_same(got, ref)
    assert max(len(r.segments) for r in packed.items) > 1
    assert all(len(r.segments) == 1 or r.input_len <= pack_tokens for r in packed.items)


def test_matches_direct_forward(toy_backend):
    """Against the model run on each request alone, outside the engine."""
    requests = _requests()
    got, _ = _run(toy_backend, requests, pack_tokens=512)
    for r in requests:
        tokens = r.tokenized_context + r.tokenized_continuation
        with torch.no_grad():
            lp = torch.log_softmax(toy_backend.model(torch.tensor([tokens[:-1]])).logits[0].float(), -1)
        n = len(r.tokenized_continuation)
        scored = lp[len(tokens) - 1 - n :]
        expected = sum(scored[k, t].item() for k, t in enumerate(r.tokenized_continuation))
        greedy = all(scored[k].argmax().item() == t for k, t in enumerate(r.tokenized_continuation))
        assert got[r.key].logprob == pytest.approx(expected, abs=1e-5)
        assert got[r.key].is_greedy == greedy


def test_too_long_documents_fall_back_to_unpacked_rows(toy_backend):
    """max_length 24: long documents would need a packed row over 24 tokens (or are truncated): they go one row
    per request, with the same truncation as unpacked; short ones still pack."""
    small = TransformersModel(toy_backend.model, toy_backend.tokenizer, max_length=24)
    requests = _requests()
    ref, _ = _run(small, requests, packing=False)
    got, packed = _run(small, _requests())
    _assert_same(got, ref)
    assert any(v.truncated for v in ref.values())
    segments = [s for r in packed.items for s in r.segments]
    assert all(s.input_len <= 24 for s in segments)
    assert any(len(s.choices) == 1 and len(s.choices[0].tokens) > 1 for s in segments)  # fell back
    assert any(s.branched for s in segments)  # still packed


def test_backend_without_packing_gets_plain_rows(toy_checkpoint):
    """A backend that does not declare supports_packed_rows (as nanotron) never sees position ids or masks; its
    multi-token rows are the old one-row-per-request batches, single-token choices share one plain row."""
    seen = []

    class PlainBackend(TransformersModel):
        supports_packed_rows = False

        def forward(self, batch):
            seen.append(batch)
            return super().forward(batch)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend = PlainBackend(AutoModelForCausalLM.from_pretrained(str(toy_checkpoint)),
                           AutoTokenizer.from_pretrained(str(toy_checkpoint)))
    backend.supports_packed_rows = False  # __init__ sets it from the attention implementation
    ref, _ = _run(backend, _requests(), packing=False, max_batch_tokens=1)
    n_plain = len(seen)
    assert all(b.position_ids is None and b.segment_ids is None for b in seen)
    got, packed = _run(backend, _requests(), pack_tokens=512)
    _assert_same(got, ref)
    assert all(len(r.segments) == 1 and not r.needs_mask for r in packed.items)
    letters = [r for r in packed.items if r.segments[0].choices[0].key[0] == "letters"]
    assert len(letters) == 3 and all(len(r.segments[0].choices) == 4 for r in letters)
    assert n_plain == len(packed.items)  # budget 1: one batch per row, so rows == batches


def test_plain_row_batch_is_the_one_row_per_request_batch():
    """A one-segment row is exactly the classic right-padded batch: inputs are all tokens but the last, the scored
    positions predict the continuation, and no position ids or mask description are attached."""
    ctx, cont = [5, 6, 7], [8, 9]
    batch = make_batch([Row([Segment(ctx, [Choice("k", cont)])]), Row([Segment([3], [Choice("j", [4])])])],
                       pad_id=0, with_mask=False)
    assert batch.input_ids.tolist() == [[5, 6, 7, 8], [3, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert batch.rows.tolist() == [0, 0, 1] and batch.cols.tolist() == [2, 3, 0] and batch.targets.tolist() == [8, 9, 4]
    assert batch.position_ids is None and batch.segment_ids is None
    with pytest.raises(ValueError, match="tree mask"):
        make_batch([Row([Segment(ctx, [Choice("a", [1, 2]), Choice("b", [3, 4])])])], pad_id=0, with_mask=False)


def test_generation_and_single_token_rows_are_plain_rows():
    """Prompt-only rows give the whole prompt and ask for the argmax at its end; single-token choices are all scored
    at the context's last position: neither needs a mask."""
    batch = make_batch([last_position_row("g", [5, 6, 7]), last_position_row("h", [1])], pad_id=0, with_mask=True)
    assert batch.input_ids.tolist() == [[5, 6, 7], [1, 0, 0]]
    assert batch.rows.tolist() == [0, 1] and batch.cols.tolist() == [2, 0] and batch.targets.tolist() == [-1, -1]
    choices = Row([Segment([5, 6], [Choice("s", [7], slot=0), Choice("s", [8], slot=1)])])
    batch = make_batch([choices], pad_id=0, with_mask=True)
    assert not choices.needs_mask and batch.position_ids is None
    assert batch.input_ids.tolist() == [[5, 6]] and batch.cols.tolist() == [1, 1] and batch.targets.tolist() == [7, 8]
