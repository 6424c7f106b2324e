"""Greedy decoding with continuous batching: the one schedule every backend's generation goes through.

A pool is every prompt of one generation setting (max_new_tokens, stop sequences) on this rank, longest first. The
pool's rows are slots: when a row finishes, its slot is given to the next waiting prompt at the next step (and
more slots open when the live rows leave room), so a batch no longer shrinks to a long tail of one slow row per
budget-sized batch: the tail comes once per pool. Rows are admitted while rows x (longest live prompt +
max_new_tokens) <= max_tokens (--batch-tokens) and rows <= max_rows (--max-batch-size); a prompt longer than the
budget runs alone. That product bounds both the KV cache (each row may need its prompt + answer columns) and every
forward.

Each step: the argmax of every row's logits; rows that hit a stop sequence, an EOS id or max_new_tokens finish;
`plan_step` decides the next rows; the decoder runs them. A backend with `incremental_decoder()` decodes from its
KV cache (nano_eval.decoder.CacheDecoder over the framework's own cache: transformers' DynamicCache, nanotron
0.4's inference `Store`, megatron-core's static inference context, nano_eval's Qwen2 cache for nanotron main): one
token per live row per step, and new prompts prefilled as a batch of their own and copied into the freed slots
(so a step with new prompts runs two forwards). Otherwise (or when the backend returns None for this model: a
layout or attention kernel its cache cannot serve exactly) every step re-runs every row's whole prompt + answer so
far, one ordinary forward (nano_eval.rows.last_position_row), which works on every backend and every TP/PP layout
but costs prompt x answer; new prompts simply join that forward.
Either way the argmax comes from the vocab-sharded logits on the output pipeline stage and is broadcast to every
rank of the replica, so all its ranks make the same decisions.

Lockstep (nano_eval.lockstep: MoE under expert parallelism): every DP rank must run the same forwards with the
same shapes. The per-step meeting (nano_eval.agreement) carries each DP rank's numbers (live rows, waiting prompts,
the rows its budget affords, the width of its next prompts, its longest row), and `plan_step` turns them into the
same plan on every rank: the pool's row count (enough for every rank's live rows, at most what every rank's budget
affords), how many prompts each rank admits, the refill prefill's rows and width (ranks with fewer prompts add
one-token filler prompts), whether a decode step runs. Rows without a prompt on a rank are dead slots that decode a
filler token, and decoding goes on until no rank has a live row or a waiting prompt.

Exactness: a row's tokens do not depend on which rows share its forwards, in exact arithmetic: its attention sees
only its own tokens (padding masked) at its own positions (counting its tokens, wherever they sit in the cache).
In floating point, batch size, padding and the column a prompt lands in change rounding (fp32: logits within
~1e-5 of the prompt alone); an argmax can only differ where two tokens are that close, and the tests check the
generations token for token against the re-run path and against each prompt decoded alone.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Collection, Iterator, Sequence

import torch

from nano_eval.agreement import Agreement
from nano_eval.backends.base import Backend
from nano_eval.lockstep import padded_batch
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


@dataclass(frozen=True)
class Plan:
    """The next step of a pool, the same on every rank that meets (see `plan_step`)."""

    rows: int  # rows of the pool after this step
    admit: tuple[int, ...]  # per DP rank: how many waiting prompts it admits
    batch: int  # rows of the refill's prefill: the most any rank admits
    width: int  # its prompt width: the longest prompt any rank admits
    decode: bool  # some rank has a live row: the kept rows run one decoding step
    columns: int  # the re-run path's forward width: the longest row any rank runs


def plan_step(numbers: Sequence[Sequence[int]]) -> Plan:
    """[DP rank] (live rows, waiting prompts, rows affordable, width of the next prompts, longest live row) -> the
    plan: as many rows as the most live rows of any rank, grown towards what the ranks can use (live + waiting) but
    never past what any rank's budget affords; each rank admits prompts into the rows its live ones leave free (and
    its own budget affords: with every rank's prompts longest first, the pool's rows never outgrow any rank's)."""
    live, waiting, affordable, width, longest = zip(*numbers)
    rows = max(max(live), min(min(affordable), max(lv + w for lv, w in zip(live, waiting))))
    admit = tuple(max(0, min(rows - lv, w, a - lv)) for lv, w, a in zip(live, waiting, affordable))
    wide = max((w for w, a in zip(width, admit) if a), default=0)
    return Plan(rows, admit, max(admit), wide, max(live) > 0, max(max(longest), wide))


def next_rows(slots: Sequence[int | None], rows: int, newcomers: Sequence[int]) -> tuple[list, list, list, list]:
    """The decoder's next rows: slots [row] -> the prompt in it (None: a dead row), the plan's row count and the
    prompts this rank admits -> (keep: current rows that stay, in order: every live row and as many dead ones as the
    plan leaves room for; empty: positions in `keep` of the dead rows kept, refilled now or decoding fillers;
    targets: the positions the admitted prompts go to, dead rows first, then new rows at the end; the new slots)."""
    live = sum(i is not None for i in slots)
    dead = [k for k, i in enumerate(slots) if i is None]
    keep = sorted([k for k, i in enumerate(slots) if i is not None] + dead[:max(0, rows - live)])
    empty = [j for j, k in enumerate(keep) if slots[k] is None]
    targets = (empty + list(range(len(keep), rows)))[:len(newcomers)]
    after = [slots[k] for k in keep] + [None] * (rows - len(keep))
    for j, i in zip(targets, newcomers):
        after[j] = i
    return keep, empty, targets, after


def simulate(prompts: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], max_new: int,
             max_tokens: int | None = None, max_rows: int | None = None) -> Iterator[tuple[Plan, list[list]]]:
    """greedy_decode's plans without a model, for costing a schedule (scripts/lockstep_cost.py, the tests): rank r's
    prompt i has prompts[r][i] tokens (longest first, as the engine orders them) and generates answers[r][i]
    (<= max_new). Yields each step's Plan and every rank's slots after it (the prompt in each row, None: dead)."""
    budget = (max_tokens or sys.maxsize, max_rows or sys.maxsize)
    contexts = [[[0] * n for n in lengths] for lengths in prompts]
    fed = [[[] for _ in lengths] for lengths in prompts]
    slots: list[list] = [[] for _ in prompts]
    waiting = [0] * len(prompts)
    while True:
        for rank, rows in enumerate(slots):
            for k, i in enumerate(rows):
                if i is not None:
                    fed[rank][i].append(0)
                    if len(fed[rank][i]) >= answers[rank][i]:
                        rows[k] = None
        numbers = [_numbers(contexts[r], fed[r], [i for i in slots[r] if i is not None], waiting[r], max_new,
                            budget, True) for r in range(len(prompts))]
        if not any(live or left for live, left, *_ in numbers):
            return
        plan = plan_step(numbers)
        for rank, admit in enumerate(plan.admit):
            slots[rank] = next_rows(slots[rank], plan.rows, range(waiting[rank], waiting[rank] + admit))[3]
            waiting[rank] += admit
        yield plan, [list(rows) for rows in slots]


def greedy_decode(backend: Backend, rows: Sequence[Row], pad_id: int, eos_ids: Collection[int],
                  vocab_shard: Callable[[torch.Tensor], VocabShard], shared_prefix_tokens: int = 0,
                  lockstep: bool = False, agreement: Agreement | None = None, max_tokens: int | None = None,
                  max_rows: int | None = None, on_done: Callable[[int], object] | None = None) -> dict:
    """{request key: GenerationResult} for a pool of generation rows that share one `Generation` (max_new_tokens,
    stop), admitted in their order (longest first is what keeps the cache within `max_tokens`).

    A row stops at a stop sequence, at any id in `eos_ids` (not kept), or after max_new_tokens. The text is the
    decoded tokens without special tokens, cut at the first stop sequence (as lm-evaluation-harness).

    Prompts that start with the same `shared_prefix_tokens` (> 0) or more tokens have that prefix prefilled once
    where the backend's cache allows it (`incremental_decoder(shared_prefix_tokens=...)`, nano_eval.decoder).

    max_tokens, max_rows: the budget rows are admitted by (module docstring; None: every prompt at once).
    lockstep (nano_eval.lockstep, for models with collectives across data-parallel ranks): every DP rank runs the
    same forwards with the same shapes (module docstring); `rows` may be empty on a rank.

    agreement (nano_eval.agreement): detokenising and stop sequences run under its guard, and every step meets
    before its forwards (under lockstep: every rank's "unfinished?", "failed?" and plan numbers in one all-reduce),
    so a fault on one rank stops every rank before the same step; the results are then incomplete and the caller's
    `settle` raises. Without one, greedy_decode settles its own at the end (every rank calls it).
    on_done(n): called as n rows finish (a progress bar).

    Every rank of the model replica calls it with the same rows; every rank returns the same results.
    """
    own = agreement is None
    agreement = agreement or Agreement(backend.layout, lockstep=lockstep)
    tok, layout = backend.tokenizer, backend.layout
    prompts = [row.segments[0] for row in rows]  # prompt tokens in .context, key and truncation in .choices[0]
    contexts = [p.context for p in prompts]
    max_new, stops = (rows[0].generation.max_new_tokens, rows[0].generation.stop) if rows else (0, ())
    fed: list[list[int]] = [[] for _ in contexts]  # tokens generated for each prompt
    ends: list[int | None] = [None] * len(rows)  # generation length once done
    broken: dict[int, int] = {}  # prompt -> the generated token whose logits were not finite
    decoder = backend.incremental_decoder(shared_prefix_tokens=shared_prefix_tokens) \
        if hasattr(backend, "incremental_decoder") else None
    decoder = decoder or _Rerun(backend)
    decoder.max_new = max_new  # every row may reach its prompt + max_new columns
    budget = (max_tokens or sys.maxsize, max_rows or sys.maxsize)
    me = layout.dp_rank if lockstep else 0
    slots: list[int | None] = []  # the prompt in each row of the decoder (None: a dead row)
    waiting = 0  # the next prompt to admit
    logits = None
    while True:
        if slots:
            next_ids = torch.zeros(len(slots), dtype=torch.int64, device=layout.device)
            if logits is not None:
                next_ids = argmax_tokens(logits, vocab_shard(logits)).to(next_ids.device)
            next_ids = broadcast_tensor_from_output_stage(next_ids, layout).tolist()
            with agreement.guard():
                for k, (i, t) in enumerate(zip(slots, next_ids)):
                    if i is None:
                        continue
                    if t == NON_FINITE:  # NaN / inf logits: the row ends here, its result says where (nano_eval.finite)
                        broken[i] = ends[i] = len(fed[i])
                    elif t in eos_ids:
                        ends[i] = len(fed[i])
                    else:
                        fed[i].append(t)
                        if len(fed[i]) == max_new or _hit_stop(decode_text(tok, fed[i]), stops):
                            ends[i] = len(fed[i])
                    if ends[i] is not None:
                        slots[k] = None
                        if on_done is not None:
                            on_done(1)
        live = [i for i in slots if i is not None]
        numbers = _numbers(contexts, fed, live, waiting, max_new, budget, decoder.refills)
        if not agreement.meet(bool(live) or waiting < len(contexts), numbers):  # all done, or some rank failed
            break
        plan = plan_step(agreement.numbers)
        newcomers = range(waiting, waiting + plan.admit[me])
        keep, empty, targets, after = next_rows(slots, plan.rows, newcomers)
        waiting += len(newcomers)
        tokens = [fed[slots[k]][-1] if slots[k] is not None else pad_id for k in keep]
        logits = decoder.step(keep, tokens, empty, targets, [contexts[i] for i in newcomers], pad_id, plan.rows,
                              decode=plan.decode, width=plan.width if lockstep else None,
                              batch=plan.batch if lockstep else len(newcomers),
                              columns=plan.columns if lockstep else None)
        slots = after
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


def _numbers(contexts: list[list[int]], fed: list[list[int]], live: list[int], waiting: int, max_new: int,
             budget: tuple[int, int], refills: bool) -> tuple[int, int, int, int, int]:
    """This rank's numbers for `plan_step`: (live rows, waiting prompts, rows its budget affords, width of the
    prompts it could admit, its longest live row). Affordable: the live rows plus the next waiting prompts while
    rows x (longest prompt + max_new) <= max_tokens (at least one row), plus dead rows when no prompt waits beyond
    (lockstep). A decoder that cannot refill (`refills` False) admits only into an empty pool: its prompts wait
    (not counted) while rows are live."""
    max_tokens, max_rows = budget
    n, need, width = len(live), max((len(contexts[i]) + max_new for i in live), default=1), 0
    queue = contexts[waiting:] if refills or not live else []
    for prompt in queue:
        wider = max(need, len(prompt) + max_new)
        if n >= max_rows or (n and (n + 1) * wider > max_tokens):
            break
        n, need, width = n + 1, wider, max(width, len(prompt))
    else:
        n = max(n, min(max_rows, max_tokens // need))
    longest = max((len(contexts[i]) + len(fed[i]) for i in live), default=0)
    return len(live), len(queue), n, width, longest


class _Rerun:
    """The re-run path behind the decoder's `step`: no cache; every step is one ordinary forward of every row's
    prompt + generated tokens (right-padded; under lockstep padded to the agreed rows and columns), logits at each
    row's last token."""

    refills = True

    def __init__(self, backend: Backend):
        self.backend, self.max_new = backend, 0
        self.seqs: list[list[int]] = []

    def step(self, keep: list[int], next_ids: list[int], empty: Sequence[int], slots: list[int],
             prompts: list[list[int]], pad_id: int, total: int, decode: bool = True, width: int | None = None,
             batch: int = 0, columns: int | None = None) -> torch.Tensor | None:
        seqs = [self.seqs[k] + [t] for k, t in zip(keep, next_ids)] + [[pad_id]] * (total - len(keep))
        for j in empty:
            seqs[j] = [pad_id]
        for j, prompt in zip(slots, prompts):
            seqs[j] = list(prompt)
        self.seqs = seqs
        batch_ = make_batch([last_position_row(None, s) for s in seqs], pad_id, with_mask=False)
        if columns is not None:  # lockstep: every rank's forward is as wide (right padding: causal attention)
            batch_ = padded_batch(batch_, total, max(columns, batch_.input_ids.shape[1]), pad_id)
        return self.backend.forward(batch_)


def _hit_stop(text: str, stops: Sequence[str]) -> bool:
    return any(s and s in text for s in stops)


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    for s in stops:
        if s and s in text:
            text = text.split(s, 1)[0]
    return text
