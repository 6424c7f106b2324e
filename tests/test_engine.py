"""The scoring core against direct computations on a real (toy) transformers model."""

import pytest
import torch

from nano_eval.backends.transformers import TransformersModel
from nano_eval.engine import BatchingConfig, Engine, rolling_windows
from nano_eval.errors import NanoEvalError
from nano_eval.tasks.requests import (
    GreedyUntilRequest,
    LoglikelihoodRequest,
    LoglikelihoodRollingRequest,
    LoglikelihoodSingleTokenRequest,
)


def _direct_logprob(model, tokens, n_scored):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens[:-1]])).logits[0].float(), -1)
    start = len(tokens) - 1 - n_scored
    return sum(lp[start + k, tokens[start + k + 1]].item() for k in range(n_scored))


def _requests():
    return [
        LoglikelihoodRequest("t", i, j, ctx, choice=choice)
        for i, ctx in enumerate(["Question: 3 plus 4\nAnswer:", "The dog runs ", "", "a b c d e f g h i j k"])
        for j, choice in enumerate([" 7", "to the house.", " blue"])
    ]


def test_encode_pair_moves_trailing_spaces_like_lm_eval(toy_backend):
    engine = Engine(toy_backend, progress=False)
    ctx, cont = engine.encode_pair("The dog runs ", "to the house.")
    enc = toy_backend.tokenizer.encode
    assert ctx == enc("The dog runs") and ctx + cont == enc("The dog runs to the house.")
    assert engine.encode_pair("", " blue") == ([engine.tokens.prefix_id], enc(" blue"))


def test_loglikelihood_matches_direct_forward_for_any_batch_budget(toy_backend):
    results = []
    for budget in (16, 64, 100_000):
        engine = Engine(toy_backend, BatchingConfig(max_batch_tokens=budget), progress=False)
        results.append(engine.run_loglikelihood(engine.prepare_loglikelihood(_requests())))
    requests = _requests()
    Engine(toy_backend, progress=False).prepare_loglikelihood(requests)
    for r in requests:
        tokens = r.tokenized_context + r.tokenized_continuation
        expected = _direct_logprob(toy_backend.model, tokens, len(r.tokenized_continuation))
        for res in results:
            assert res[r.key].logprob == pytest.approx(expected, abs=1e-5)
            assert res[r.key].num_tokens == len(r.tokenized_continuation)
        assert results[0][r.key].is_greedy == results[2][r.key].is_greedy


def test_head_on_scored_positions_equals_full_logits(toy_backend):
    full = TransformersModel(toy_backend.model, toy_backend.tokenizer)
    full._head_only_on_scored = False
    a = Engine(toy_backend, progress=False)
    b = Engine(full, progress=False)
    ra, rb = (e.run_loglikelihood(e.prepare_loglikelihood(_requests())) for e in (a, b))
    for k in ra:
        assert ra[k].logprob == pytest.approx(rb[k].logprob, abs=1e-5)


def test_rolling_windows_score_each_token_once_like_lm_eval():
    tokens = list(range(100, 123))
    windows = list(rolling_windows(tokens, 0, max_len=5))
    assert [t for _, cont in windows for t in cont] == tokens
    assert all(len(c) + len(x) <= 6 for c, x in windows)
    lm_utils = pytest.importorskip("lm_eval.utils")
    ref = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(tokens, 0, 5, 1)]
    assert [tuple(map(list, w)) for w in ref] == windows


def test_rolling_loglikelihood_equals_sum_of_windows(toy_backend):
    text = "The man runs to the house. " * 80
    engine = Engine(toy_backend, progress=False)
    request = LoglikelihoodRollingRequest("t", 0, 0, text)
    results = engine.run_loglikelihood(engine.prepare_rolling([request]))
    tokens = toy_backend.tokenizer.encode(text)
    assert len(tokens) > toy_backend.max_length  # several windows
    expected = sum(
        _direct_logprob(toy_backend.model, ctx + cont, len(cont))
        for ctx, cont in rolling_windows(tokens, engine.tokens.prefix_id, toy_backend.max_length)
    )
    assert sum(r.logprob for r in results.values()) == pytest.approx(expected, abs=1e-3)
    assert sum(r.num_tokens for r in results.values()) == len(tokens)


def test_single_token_choices_from_one_forward(toy_backend):
    engine = Engine(toy_backend, progress=False)
    context = "Question: 3 plus 4\nAnswer:"
    choices = [" 7", " 8", " 1"]
    single = LoglikelihoodSingleTokenRequest("t", 0, 0, context, choices=choices)
    res = engine.run_loglikelihood(engine.prepare_single_token([single]))[single.key]
    multi = [LoglikelihoodRequest("t", 0, j, context, choice=c) for j, c in enumerate(choices)]
    ref = engine.run_loglikelihood(engine.prepare_loglikelihood(multi))
    assert [r.logprob for r in res] == pytest.approx([ref[m.key].logprob for m in multi], abs=1e-5)


def test_greedy_matches_transformers_generate(toy_backend):
    engine = Engine(toy_backend, BatchingConfig(max_batch_tokens=64), progress=False)
    prompts = ["Question: 3 plus 4\nAnswer:", "The dog", "Question: 9 plus 9\nAnswer:"]
    requests = [GreedyUntilRequest("t", i, 0, p, stop_sequence=[], generation_size=6) for i, p in enumerate(prompts)]
    results = engine.run_greedy(engine.prepare_greedy(requests))
    tok = toy_backend.tokenizer
    for r, p in zip(requests, prompts):
        ids = torch.tensor([tok.encode(p)])
        out = toy_backend.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.eos_token_id)
        expected = out[0, ids.shape[1]:].tolist()
        if tok.eos_token_id in expected:
            expected = expected[: expected.index(tok.eos_token_id)]
        assert results[r.key].tokens == expected


def test_greedy_stops_at_stop_sequence(toy_backend):
    engine = Engine(toy_backend, progress=False)
    free = GreedyUntilRequest("t", 0, 0, "The dog", generation_size=8)
    text = engine.run_greedy(engine.prepare_greedy([free]))[free.key].text
    assert len(text) > 2
    stop = text[1:3]
    cut = GreedyUntilRequest("t", 1, 0, "The dog", stop_sequence=[stop], generation_size=8)
    result = engine.run_greedy(engine.prepare_greedy([cut]))[cut.key]
    assert result.text == text.split(stop, 1)[0]
    assert len(result.tokens) < 8 or stop not in text


def test_long_context_is_left_truncated_and_counted(toy_backend):
    engine = Engine(toy_backend, progress=False)
    long_ctx = "one two three " * 200
    r = LoglikelihoodRequest("t", 0, 0, long_ctx, choice=" four")
    result = engine.run_loglikelihood(engine.prepare_loglikelihood([r]))[r.key]
    n = len(r.tokenized_context) + len(r.tokenized_continuation)
    assert result.truncated == n - (toy_backend.max_length + 1) > 0


def test_continuation_longer_than_model_is_a_clear_error(toy_backend):
    engine = Engine(toy_backend, progress=False)
    r = LoglikelihoodRequest("mytask", 3, 0, "x", choice=" one two" * 300)
    with pytest.raises(NanoEvalError, match="mytask.*document 3.*--max-length"):
        engine.prepare_loglikelihood([r])


def _with_added_tokens(toy_backend, toy_checkpoint, **special):
    """The toy model with its own tokenizer, to which tokens the model has no embedding rows for were added."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(toy_checkpoint))
    tokenizer.add_tokens(["zzqnewword"])
    tokenizer.add_special_tokens(special)
    backend = TransformersModel(toy_backend.model, tokenizer, max_length=toy_backend.max_length)
    assert len(tokenizer) > backend.vocab_size == toy_backend.model.get_input_embeddings().num_embeddings
    return backend


def test_a_token_the_model_has_no_row_for_is_refused_before_any_forward(toy_backend, toy_checkpoint):
    """Another model's tokenizer, or tokens added to this one: the embedding lookup would fail mid-run (on a GPU: a
    device-side assert that ends the process); every request kind names the task and document instead."""
    engine = Engine(_with_added_tokens(toy_backend, toy_checkpoint), progress=False)
    for prepare, request in [
        (engine.prepare_loglikelihood, LoglikelihoodRequest("t", 3, 0, "Question: zzqnewword?", choice=" yes")),
        (engine.prepare_loglikelihood, LoglikelihoodRequest("t", 3, 0, "Question:", choice=" zzqnewword")),
        (engine.prepare_single_token, LoglikelihoodSingleTokenRequest("t", 3, 0, "Q:", choices=[" a", "zzqnewword"])),
        (engine.prepare_rolling, LoglikelihoodRollingRequest("t", 3, 0, "one zzqnewword two")),
        (engine.prepare_greedy, GreedyUntilRequest("t", 3, 0, "zzqnewword", stop_sequence=[], generation_size=4)),
    ]:
        with pytest.raises(NanoEvalError, match=r"task t, document 3: token id \d+ is past the model's \d+ embedding"):
            prepare([request])


def test_a_pad_token_past_the_models_rows_is_replaced(toy_backend, toy_checkpoint):
    """A pad token added to the tokenizer only (a common fix for tokenizers without one): padding is masked, so any
    id the model has a row for pads equally well, and scores equal those of the tokenizer without it."""
    backend = _with_added_tokens(toy_backend, toy_checkpoint, pad_token="<zzqpad>")
    assert backend.tokenizer.pad_token_id >= backend.vocab_size
    engine = Engine(backend, BatchingConfig(max_batch_tokens=64), progress=False)
    assert engine.pad_id < backend.vocab_size
    reference = Engine(toy_backend, BatchingConfig(max_batch_tokens=64), progress=False)
    got, expected = (e.run_loglikelihood(e.prepare_loglikelihood(_requests())) for e in (engine, reference))
    assert {k: r.logprob for k, r in got.items()} == pytest.approx({k: r.logprob for k, r in expected.items()},
                                                                   abs=1e-6)
