"""Greedy decoding, one batch of prompts at a time: the one driver every backend's generation goes through.

A backend with `incremental_decoder()` runs each prompt once and then one token per row per step from its KV
cache, so the cost grows with prompt + answer length: a nano_eval.decoder.CacheDecoder (left padding, shared
prefixes, finished rows dropped, the cache sized to the batch) over the framework's own cache (transformers: its
DynamicCache grown in place; nanotron 0.4: its inference `Store`; Megatron: megatron-core's static inference
context). When a backend has no decoder, or returns None for this model (a layout or attention kernel its cache
cannot serve exactly), the whole prompt (plus what was generated) is re-run for every new token, one ordinary
forward of prompt-only rows (nano_eval.rows.last_position_row), which works on every backend and every TP/PP
layout but costs prompt x answer.
Either way the argmax comes from the vocab-sharded logits on the output pipeline stage and is broadcast to every
rank of the replica, so all ranks agree on when to stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection, Sequence

import torch

from nano_eval.agreement import Agreement
from nano_eval.backends.base import Backend
from nano_eval.lockstep import Lockstep, padded_batch
from nano_eval.parallel import broadcast_tensor_from_output_stage
from nano_eval.rows import Row, last_position_row, make_batch
from nano_eval.scoring import NON_FINITE, VocabShard, argmax_tokens
from nano_eval.tokenization import decode_text


@dataclass(frozen=True)
class GenerationResult:
    text: str
    tokens: list[int]
    input_tokens: list[int]
    truncated: int
    non_finite_at: int | None = None  # the generated token whose logits held NaN / inf (decoding stopped there)


def greedy_decode(backend: Backend, rows: Sequence[Row], pad_id: int, eos_ids: Collection[int],
                  vocab_shard: Callable[[torch.Tensor], VocabShard], shared_prefix_tokens: int = 0,
                  lockstep: Lockstep | None = None, agreement: Agreement | None = None) -> dict:
    """{request key: GenerationResult} for generation rows that share one `Generation` (max_new_tokens, stop).

    A row stops at a stop sequence, at any id in `eos_ids` (not kept), or after max_new_tokens. The text is the
    decoded tokens without special tokens, cut at the first stop sequence (as lm-evaluation-harness).

    Prompts that start with the same `shared_prefix_tokens` (> 0) or more tokens have that prefix prefilled once
    where the backend's cache allows it (`incremental_decoder(shared_prefix_tokens=...)`, nano_eval.decoder).

    lockstep (nano_eval.lockstep, for models with collectives across data-parallel ranks): its filler prompts are
    decoded after `rows` (which may be empty), prompts are padded to its agreed width, no row leaves the batch
    (finished rows go on decoding, their tokens dropped), and the loop runs until no data-parallel rank has an
    unfinished row, so every DP rank runs the same forwards with the same shapes.

    agreement (nano_eval.agreement): detokenising and stop sequences run under its guard, and every decoding step
    ends with its meeting (under lockstep: every rank's "unfinished?" and "failed?" in one all-reduce), so a fault on
    one rank stops every rank after the same step; the results are then incomplete and the caller's `settle` raises.
    Without one, greedy_decode settles its own at the end (every rank calls it).

    Every rank of the model replica calls it with the same rows; every rank returns the same results.
    """
    own = agreement is None
    agreement = agreement or Agreement(backend.layout, lockstep=lockstep is not None)
    tok, layout = backend.tokenizer, backend.layout
    prompts = [row.segments[0] for row in rows]  # prompt tokens in .context, key and truncation in .choices[0]
    contexts = [p.context for p in prompts] + (lockstep.fillers if lockstep else [])
    max_new, stops = (rows[0].generation.max_new_tokens, rows[0].generation.stop) if rows else (0, ())
    steps = lockstep.max_new_tokens if lockstep else max_new
    fed: list[list[int]] = [[] for _ in contexts]  # tokens appended to each row: its generation (+ lockstep's filler)
    ends: list[int | None] = [None] * len(rows) + [0] * (len(contexts) - len(rows))  # generation length once done
    active = list(range(len(contexts)))  # rows still in the batch, in the decoder's row order
    broken: dict[int, int] = {}  # row -> the generated token whose logits were not finite
    decoder = None
    if hasattr(backend, "incremental_decoder"):
        decoder = backend.incremental_decoder(shared_prefix_tokens=shared_prefix_tokens)
    width = lockstep.width if lockstep else None
    logits = decoder.prefill(contexts, pad_id, steps, width) if decoder is not None else None
    for step in range(steps):
        if decoder is None:
            step_rows = [last_position_row(None, contexts[i] + fed[i]) for i in active]
            batch = make_batch(step_rows, pad_id, with_mask=False)
            if lockstep:  # every rank's forward is as wide (right padding: causal attention keeps it out)
                batch = padded_batch(batch, len(step_rows), max(width + step, batch.input_ids.shape[1]), pad_id)
            logits = backend.forward(batch)
        next_ids = torch.zeros(len(active), dtype=torch.int64, device=layout.device)
        if logits is not None:
            next_ids = argmax_tokens(logits, vocab_shard(logits)).to(next_ids.device)
        next_ids = broadcast_tensor_from_output_stage(next_ids, layout).tolist()
        keep = []  # positions in `active` of the rows that go on
        with agreement.guard():
            for k, (i, t) in enumerate(zip(active, next_ids)):
                if t == NON_FINITE:  # NaN / inf logits: the row ends here, its result says where (nano_eval.finite)
                    if ends[i] is None:
                        broken[i] = ends[i] = len(fed[i])
                    t = next_ids[k] = pad_id  # what a lockstep row goes on decoding with
                if ends[i] is None and t in eos_ids:
                    ends[i] = len(fed[i])
                if ends[i] is None or lockstep:
                    fed[i].append(t)
                if ends[i] is None and (len(fed[i]) == max_new
                                        or _hit_stop(decode_text(tok, fed[i]), stops)):
                    ends[i] = len(fed[i])
                if ends[i] is None or lockstep:
                    keep.append(k)
        if not agreement.meet(any(ends[i] is None for i in active)):  # all done, or some rank failed
            break
        if decoder is not None:
            logits = decoder.extend(keep, [next_ids[k] for k in keep])
        active = [active[k] for k in keep]
    out = {}
    with agreement.guard():
        for i, (prompt, tokens, end) in enumerate(zip(prompts, fed, ends)):
            if agreement.stopped or agreement.error is not None:
                break  # some rank failed: the caller's settle raises
            choice, gen = prompt.choices[0], tokens[:end]
            out[choice.key] = GenerationResult(text=_cut_at_stop(decode_text(tok, gen), stops),
                                               tokens=gen, input_tokens=prompt.context, truncated=choice.truncated,
                                               non_finite_at=broken.get(i))
    if own:
        agreement.settle()
    return out


def _hit_stop(text: str, stops: Sequence[str]) -> bool:
    return any(s and s in text for s in stops)


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    for s in stops:
        if s and s in text:
            text = text.split(s, 1)[0]
    return text
