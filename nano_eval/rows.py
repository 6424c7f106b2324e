"""The one row type and the one batch builder: every forward nano_eval runs is a batch of `Row`s.

A row is what the model sees in one batch line: an optional prefix shared by all its segments, then one or more
segments side by side. A segment is one document's context and the continuations scored against it:

- a plain row: one segment, one continuation (context + continuation, or a rolling-perplexity window);
- single-token choices: one segment whose continuations are one token each, all scored at the context's last
  position (no input tokens are added, so it is still a plain causal row);
- generation: one segment holding the prompt and one `ARGMAX` "continuation": only the argmax at the prompt's
  last position is wanted (the prompt is the whole input);
- packed rows (nano_eval.packing): several continuations of one document, several documents, a shared few-shot
  prefix; they need a tree mask, which only backends declaring `supports_packed_rows` take.

Mask description (optional `Batch` fields): token i may attend token j iff j <= i and either j is in the row's
shared prefix (segment_ids[j] == PREFIX, i not padding), or segment_ids equal (same document) and branch_ids[j]
is 0 (the document's context) or equals branch_ids[i] (the same continuation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from nano_eval.backends.base import Batch

PAD, PREFIX = -1, -2  # segment ids of padding and of a row's shared prefix
ARGMAX = -1  # target id of a position whose argmax alone is wanted (generation)


@dataclass
class Choice:
    """One continuation: its tokens are all scored; the first one at the context's last position."""

    key: Any  # the result is stored under this key (a request key, or (request key, window))
    tokens: list[int]
    truncated: int = 0  # context tokens dropped on the left for this request
    slot: int | None = None  # set: the result is item `slot` of a list stored under `key` (single-token requests)


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


@dataclass(frozen=True)
class Generation:
    """What a generation row decodes: at most `max_new_tokens`, stopping at any of `stop` (or EOS)."""

    max_new_tokens: int
    stop: tuple[str, ...] = ()


@dataclass
class Row:
    """One model row: an optional prefix shared by all its segments, then one or more segments side by side."""

    segments: list[Segment] = field(default_factory=list)
    prefix: list[int] = field(default_factory=list)  # context tokens every segment's context starts with
    generation: Generation | None = None  # set on generation rows only

    @property
    def input_len(self) -> int:
        return len(self.prefix) + sum(s.input_len for s in self.segments)

    @property
    def length(self) -> int:
        """Input tokens + 1: the tokens of context and continuations (the model sees all but the last)."""
        return self.input_len + 1

    @property
    def needs_mask(self) -> bool:
        return len(self.segments) > 1 or bool(self.prefix) or any(s.branched for s in self.segments)


def plain_row(key: Any, context: list[int], continuation: list[int], truncated: int = 0) -> Row:
    """The row of one request: `continuation` scored after `context` (a causal row, no mask needed)."""
    return Row([Segment(context, [Choice(key, continuation, truncated)])])


def last_position_row(key: Any, tokens: list[int], truncated: int = 0, generation: Generation | None = None) -> Row:
    """A prompt-only row: the whole of `tokens` goes in, the argmax at its last position comes out."""
    return Row([Segment(tokens, [Choice(key, [ARGMAX], truncated)])], generation=generation)


def common_prefix_length(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many first tokens `a` and `b` share (at most `limit`): what packed scoring and generation store once."""
    n = min(len(a), len(b)) if limit is None else min(limit, len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int,
                width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [b, w] int64, mask [b, w] bool: True on real tokens) with each prompt right-aligned (pads first), w the
    longest prompt (or `width`, when wider: lockstep's agreed width): how the KV-cache decoders take a batch, so
    every row's newest token sits in the last column."""
    width = max(max(len(p) for p in prompts), width or 0)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for r, prompt in enumerate(prompts):
        ids[r, width - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
        mask[r, width - len(prompt):] = True
    return ids, mask


def make_batch(rows: Sequence[Row], pad_id: int, with_mask: bool) -> Batch:
    """Right-padded batch of rows, scored positions in (row, segment, choice, token) order.

    Position / segment / branch ids are attached only when `with_mask` (the backend takes tree masks) and some
    row needs a mask; otherwise every row must be a plain causal row (one segment, at most one branching
    continuation) and the batch carries no mask description.
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


def split_scores(rows: Sequence[Row], logprobs: list[float], greedy: list[bool]) -> Iterator[tuple]:
    """(choice, summed log-prob, all greedy, n tokens) per continuation, reading make_batch's order."""
    k = 0
    for row in rows:
        for sg in row.segments:
            for choice in sg.choices:
                n = len(choice.tokens)
                yield choice, sum(logprobs[k : k + n]), all(greedy[k : k + n]), n
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
