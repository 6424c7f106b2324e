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

The row type, the batch builder and the tree mask live in nano_eval.rows.
"""

from __future__ import annotations

from typing import Any, Sequence

from nano_eval.rows import Choice, Row, Segment, common_prefix_length


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


def pack_rows(segments: Sequence[Segment], capacity: int) -> list[Row]:
    """Rows of several segments up to `capacity` input tokens (0: one segment per row).

    Deterministic: segments sorted longest first; each row starts with the longest left and is topped up with the
    shortest left while they fit (so short documents fill the room beside long ones).
    """
    if capacity <= 0:
        return [Row([s]) for s in segments]
    order = sorted(range(len(segments)), key=lambda i: (-segments[i].input_len, i))
    rows, lo, hi = [], 0, len(order) - 1
    while lo <= hi:
        row = Row([segments[order[lo]]])
        lo += 1
        while lo <= hi and row.input_len + segments[order[hi]].input_len <= capacity:
            row.segments.append(segments[order[hi]])
            hi -= 1
        rows.append(row)
    return rows


def share_prefixes(segments: Sequence[Segment], capacity: int, min_prefix: int) -> tuple[list[Row], list]:
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
            rows.append(Row([Segment(s.context[shared:], s.choices) for s in run], run[0].context[:shared]))
        else:
            left.extend(run)

    for seg in sorted(filter(eligible, segments), key=lambda s: s.context):
        if run:
            common = min(common_prefix_length(run[0].context, seg.context, shared), len(seg.context) - 1)
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

