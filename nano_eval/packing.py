"""Shared-prefix packing: score every continuation of a document in one row, the context run once.

A multiple-choice document asks for log P(choice | context) for every choice. Scored one row per request, the
context goes through the model once per choice (4x on HellaSwag). A packed row holds the context once, then each
continuation's input tokens; a tree mask lets each continuation see the context and itself only, and position ids
restart each continuation right after the context, so every scored logit is the one a separate row would give.
Several short documents can share a row too (block-diagonal mask, positions restart per document).

Single-token continuations add no input tokens at all: every choice is scored at the context's last position,
so such a document is a plain causal row. That needs no mask, so it is used for every backend.

Documents whose contexts start with the same tokens (MMLU's fixed 5-shot examples) can share that prefix too:
a row then holds the prefix once, then each document's remaining context and continuations.

Mask description (optional `Batch` fields): token i may attend token j iff j <= i and either j is in the row's
shared prefix (segment_ids[j] == PREFIX, i not padding), or segment_ids equal (same document) and branch_ids[j]
is 0 (the document's context) or equals branch_ids[i] (the same continuation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from nano_eval.models.base import Batch

PAD, PREFIX = -1, -2  # segment ids of padding and of a row's shared prefix


@dataclass
class Choice:
    key: Any  # request key the result is stored under
    tokens: list[int]  # continuation tokens: all scored
    truncated: int = 0  # context tokens dropped on the left for this request


@dataclass
class Segment:
    """One document's context and the continuations scored against it."""

    context: list[int]
    choices: list[Choice]

    @property
    def input_len(self) -> int:
        return len(self.context) + sum(len(c.tokens) - 1 for c in self.choices)

    @property
    def branched(self) -> bool:
        """True when more than one continuation adds input tokens (then a plain causal mask is wrong)."""
        return sum(len(c.tokens) > 1 for c in self.choices) > 1


@dataclass
class PackedRow:
    """One model row: an optional prefix shared by all its segments, then one or more segments side by side."""

    segments: list[Segment] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # context tokens every segment's context starts with

    @property
    def input_len(self) -> int:
        return len(self.prefix) + sum(s.input_len for s in self.segments)

    @property
    def length(self) -> int:
        """Input tokens + 1, the same convention as ScoringItem.length (the model sees all tokens but the last)."""
        return self.input_len + 1

    @property
    def needs_mask(self) -> bool:
        return len(self.segments) > 1 or bool(self.prefix) or any(s.branched for s in self.segments)


def build_segments(groups: Sequence[list[tuple[Any, list[int], list[int]]]], max_length: int,
                   tree: bool) -> list[Segment]:
    """Segments for groups of (key, context, continuation) sharing one context (one document's requests).

    `tree`: the backend takes tree masks, so a group becomes one segment when nothing in it is truncated and the
    packed segment fits in `max_length`. Groups whose continuations are all one token become one segment for every
    backend (context cut on the left exactly as each request alone would be). Anything else: one segment per
    request, identical to the unpacked row (context cut on the left to max_length + 1 tokens in all).
    """
    out = []
    for group in groups:
        context = group[0][1]
        conts = [cont for _, _, cont in group]
        if context and all(len(c) == 1 for c in conts):
            cut = max(0, len(context) - max_length)
            out.append(Segment(context[cut:], [Choice(k, cont, cut) for k, _, cont in group]))
            continue
        seg = Segment(context, [Choice(k, cont) for k, _, cont in group])
        fits = context and all(len(context) + len(c) <= max_length + 1 for c in conts) and seg.input_len <= max_length
        if tree and fits:
            out.append(seg)
            continue
        for key, ctx, cont in group:
            tokens = ctx + cont
            cut = max(0, len(tokens) - (max_length + 1))
            out.append(Segment(tokens[cut : len(tokens) - len(cont)], [Choice(key, cont, cut)]))
    return out


def pack_rows(segments: Sequence[Segment], capacity: int) -> list[PackedRow]:
    """Rows of several segments up to `capacity` input tokens (0: one segment per row).

    Deterministic: segments sorted longest first; each row starts with the longest left and is topped up with the
    shortest left while they fit (so short documents fill the room beside long ones).
    """
    if capacity <= 0:
        return [PackedRow([s]) for s in segments]
    order = sorted(range(len(segments)), key=lambda i: (-segments[i].input_len, i))
    rows, lo, hi = [], 0, len(order) - 1
    while lo <= hi:
        row = PackedRow([segments[order[lo]]])
        lo += 1
        while lo <= hi and row.input_len + segments[order[hi]].input_len <= capacity:
            row.segments.append(segments[order[hi]])
            hi -= 1
        rows.append(row)
    return rows


def share_prefixes(segments: Sequence[Segment], capacity: int, min_prefix: int) -> tuple[list[PackedRow], list]:
    """Rows of documents whose contexts start with the same >= `min_prefix` tokens, that prefix stored once.

    Segments sorted by context tokens put long common prefixes next to each other; a run grows while its common
    prefix stays >= min_prefix and the row stays within `capacity` tokens. Every document keeps at least one
    context token of its own (its first continuation token is scored there). Returns (rows, segments left).
    """
    def eligible(s: Segment) -> bool:
        return len(s.context) > min_prefix and not any(c.truncated for c in s.choices)

    left = [s for s in segments if not eligible(s)]
    rows, run, shared = [], [], 0

    def flush():
        if len(run) > 1:
            rows.append(PackedRow([Segment(s.context[shared:], s.choices) for s in run], run[0].context[:shared]))
        else:
            left.extend(run)

    for seg in sorted(filter(eligible, segments), key=lambda s: s.context):
        if run:
            common = min(_common_len(run[0].context, seg.context), shared, len(seg.context) - 1)
            cost = sum(s.input_len for s in run) + seg.input_len - len(run) * common
            if common >= min_prefix and cost <= capacity:
                run.append(seg)
                shared = common
                continue
            flush()
        run, shared = [seg], len(seg.context) - 1
    if run:
        flush()
    return rows, left


def _common_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def make_packed_batch(rows: Sequence[PackedRow], pad_id: int, with_mask: bool) -> Batch:
    """Right-padded batch of packed rows, scored positions in (row, segment, choice, token) order.

    Without `with_mask` every row must be a plain causal row (one segment, at most one branching continuation);
    the batch is then exactly what one row per request gives (no position ids, no mask description).
    """
    width = max(r.input_len for r in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.int64)
    attention = torch.zeros(shape, dtype=torch.int64)
    position = torch.zeros(shape, dtype=torch.int64)
    segment = torch.full(shape, PAD, dtype=torch.int64)
    branch = torch.zeros(shape, dtype=torch.int64)
    rows_idx, cols, targets = [], [], []
    for r, row in enumerate(rows):
        if not with_mask and row.needs_mask:
            raise ValueError("a packed row needs a tree mask but the backend takes none")
        n_pre = len(row.prefix)
        ids, pos, seg, br = list(row.prefix), list(range(n_pre)), [PREFIX] * n_pre, [0] * n_pre
        for s, sg in enumerate(row.segments):
            offset, n_ctx = len(ids), len(sg.context)
            ids += sg.context
            pos += range(n_pre, n_pre + n_ctx)
            seg += [s] * n_ctx
            br += [0] * n_ctx
            for b, choice in enumerate(sg.choices, start=1):
                start, n_in = len(ids), len(choice.tokens) - 1
                ids += choice.tokens[:-1]
                pos += range(n_pre + n_ctx, n_pre + n_ctx + n_in)
                seg += [s] * n_in
                br += [b] * n_in
                rows_idx += [r] * len(choice.tokens)
                cols += [offset + n_ctx - 1, *range(start, start + n_in)]
                targets += choice.tokens
        n = len(ids)
        input_ids[r, :n], attention[r, :n] = torch.tensor(ids), 1
        position[r, :n], segment[r, :n], branch[r, :n] = torch.tensor(pos), torch.tensor(seg), torch.tensor(br)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    batch = Batch(input_ids, attention, as_long(rows_idx), as_long(cols), as_long(targets))
    if with_mask and any(r.needs_mask for r in rows):
        batch.position_ids, batch.segment_ids, batch.branch_ids = position, segment, branch
    return batch


def split_packed(rows: Sequence[PackedRow], logprobs: list[float], greedy: list[bool]) -> Iterator[tuple]:
    """(key, summed log-prob, all greedy, n tokens, truncated) per request, reading make_packed_batch's order."""
    k = 0
    for row in rows:
        for sg in row.segments:
            for choice in sg.choices:
                n = len(choice.tokens)
                yield choice.key, sum(logprobs[k : k + n]), all(greedy[k : k + n]), n, choice.truncated
                k += n


def tree_attention_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, 1, S, S] mask, True where query i may attend key j (see the module docstring).

    Padding (PAD) attends earlier padding only, so no query row is fully masked (no NaN in softmax).
    """
    s = segment_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril_()
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    key_branch = branch_ids[:, None, :]
    visible = same_doc & ((key_branch == 0) | (key_branch == branch_ids[:, :, None]))
    shared = (segment_ids[:, None, :] == PREFIX) & (segment_ids[:, :, None] != PAD)
    return ((visible | shared) & causal)[:, None]
