"""Models whose layers are not all full causal attention (sliding windows: Mistral, Gemma-2, Gemma-3) get neither a
shared generation prefix nor packed scoring rows, and score and generate exactly as each request alone.

transformers applies a sliding window by column. Shared-prefix decoding lays rows out [prefix | padding | suffix], so
a short row's window covered padding columns instead of its real tokens (logits 0.1-0.5 off at prefill); packed rows
carry a custom 4D mask, which replaces transformers' window masks (log-probs up to 1.7 off). Tiny random models from
transformers' own classes, window 6, 4-shot prompts of ~60 tokens.
"""

from __future__ import annotations

import pytest
import torch

from nano_eval.backends.transformers import TransformersModel, attention_kinds
from nano_eval.engine import BatchingConfig, Engine
from nano_eval.tasks.requests import GreedyUntilRequest, LoglikelihoodRequest

SHOTS = "".join(f"Question: {a} plus {b}\nAnswer: {a + b}\n\n" for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)])
COMMON = dict(vocab_size=544, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def _model(name: str):
    import transformers as tf

    torch.manual_seed(0)
    if name == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**COMMON, sliding_window=6))
    elif name == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**COMMON, sliding_window=6, query_pre_attn_scalar=16))
    else:
        model = tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**COMMON, sliding_window=6,
                                                         layer_types=["sliding_attention", "full_attention"]))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.15)  # opinions: attention to the wrong tokens moves logits visibly
    return model.eval()


@pytest.fixture(scope="module", params=["mistral", "gemma2", "gemma3"])
def backend(request, toy_checkpoint):
    from transformers import AutoTokenizer

    return TransformersModel(_model(request.param), AutoTokenizer.from_pretrained(str(toy_checkpoint)))


def _prompts(tok, n=5):
    return [tok(SHOTS + f"Question: {i} plus {3 * i % 10}\nAnswer:" + " so" * (i % 5))["input_ids"] for i in range(n)]


def test_layer_kinds_are_read_from_the_config(backend):
    assert "sliding_attention" in backend.attention_kinds
    assert not backend.shares_prompt_prefix and not backend.supports_packed_rows
    from transformers import LlamaConfig, Qwen2Config

    assert attention_kinds(LlamaConfig()) == {"full_attention"}
    assert attention_kinds(Qwen2Config()) == {"full_attention"}  # use_sliding_window=False
    assert attention_kinds(Qwen2Config(use_sliding_window=True, max_window_layers=0)) == {"sliding_attention"}


def test_decoder_prefill_equals_each_prompt_alone(backend):
    """Asked to share a 4-shot prefix (as the engine asks), the decoder gives every row the logits of its prompt
    alone; before the fix the shared layout was 0.1-0.5 off."""
    prompts = _prompts(backend.tokenizer)
    with torch.no_grad():
        batched = backend.incremental_decoder(shared_prefix_tokens=32).prefill(prompts, 0, 4)
        alone = torch.stack([backend.model(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=1e-4)


def test_generations_and_scores_equal_each_request_alone(backend):
    """Through the engine with its default batching (shared prefixes and packed rows allowed where the model takes
    them): greedy tokens equal the one-prompt-at-a-time re-run; per-request log-probs equal each request scored
    alone in a plain row (before the fix, packed rows were up to 1.7 off)."""
    gen = [GreedyUntilRequest("g", i, 0, SHOTS + f"Question: {i} plus 2\nAnswer:" + " so" * (i % 3),
                              stop_sequence=[], generation_size=6) for i in range(5)]
    ll = [LoglikelihoodRequest("l", i, c, SHOTS + f"Question: {i} plus 2\nAnswer:", choice=f" {i + c}")
          for i in range(4) for c in range(2, 4)]
    one = Engine(backend, BatchingConfig(max_batch_size=1, packing=False, shared_prefix_tokens=0), progress=False)
    many = Engine(backend, BatchingConfig(max_batch_tokens=10_000), progress=False)
    with torch.no_grad():
        alone = {k: r.tokens for k, r in one.run_greedy(one.prepare_greedy(gen)).items()}
        together = {k: r.tokens for k, r in many.run_greedy(many.prepare_greedy(gen)).items()}
        scores_alone = one.run_loglikelihood(one.prepare_loglikelihood(ll))
        scores = many.run_loglikelihood(many.prepare_loglikelihood(ll))
    assert together == alone
    worst = max(abs(scores[k].logprob - scores_alone[k].logprob) for k in scores_alone)
    assert worst < 1e-4, f"log-probs of packed rows differ by {worst:.2e}"


def test_refilled_slots_and_trimmed_columns_equal_each_prompt_alone(backend):
    """Continuous batching on sliding-window caches: a finished row's slot takes a new prompt (copied in, left
    padding in front), the full cache drops the leading columns no live row holds, and every row's logits stay its
    own sequence's alone (transformers' sliding layers keep only the window's last columns: rows are written and
    trimmed within them)."""
    tok = backend.tokenizer
    prompts = _prompts(tok, 3)
    newcomer = tok("Question: 7 plus 1\nAnswer:")["input_ids"]
    decoder = backend.incremental_decoder()
    assert decoder.refills

    def alone(seq):
        return backend.model(torch.tensor([seq])).logits[0, -1]

    with torch.no_grad():
        decoder.prefill(prompts[:2], 0, 4)
        seqs = [list(prompts[0]), list(prompts[1])]
        for t in range(2):
            step = decoder.extend([0, 1], [20 + t, 30 + t])
            seqs[0].append(20 + t)
            seqs[1].append(30 + t)
        step = decoder.extend([0, 1], [22, 0], empty=[1])  # row 1 finished: its slot takes the newcomer
        seqs[0].append(22)
        added = decoder.admit([1], [newcomer], 0)
        torch.testing.assert_close(added[0], alone(newcomer), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(step[0], alone(seqs[0]), atol=1e-4, rtol=1e-4)
        seqs[1] = list(newcomer)
        columns = decoder.real.shape[1]
        for t in range(4):  # row 0 ends after its 4th token; the newcomer goes on until the cache must be trimmed
            keep, empty = ([0, 1], []) if t == 0 else ([0, 1], [0])
            step = decoder.extend(keep, [23 if t == 0 else 0, 40 + t], empty=empty)
            seqs[1].append(40 + t)
            if t == 0:
                seqs[0].append(23)
                torch.testing.assert_close(step[0], alone(seqs[0]), atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(step[1], alone(seqs[1]), atol=1e-4, rtol=1e-4)
        assert decoder.real.shape[1] < columns + 4  # leading columns were dropped
