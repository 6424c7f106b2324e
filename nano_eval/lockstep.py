"""Lockstep forwards: every data-parallel rank runs the same number of forwards with the same shapes.

For models whose forward holds collectives across data-parallel ranks (a backend with `lockstep = True`: MoE layers
under expert parallelism, whose token dispatch is an all-to-all or all-gather over the expert-parallel group). Each
DP rank cuts its own batches, so without this one rank would wait in its extra forward's first MoE layer until the
process group's timeout; the all-gather dispatcher also needs the same token count on every rank.

- Once per run, one all_gather_object over the DP group of each rank's batch shapes; batch i gets, on every rank,
  the largest shape any rank has for it (`scoring_plan`, `generation_plan`), and ranks with fewer batches run
  dummy ones.
- Scoring: each batch is padded to its agreed [rows, columns] with padding rows and right-padding columns
  (`padded_batch`: the scored positions stay where they are; causal attention and dropless routing keep padding
  out of them); a dummy batch is all padding with one scored position whose logits are dropped.
- Generation (`Lockstep`): batch i has as many rows and as wide a left-padded prompt block on every rank (filler
  prompts: one as long as the longest prompt of any rank, the others one token), finished rows keep decoding
  (their tokens are dropped), and decoding goes on until no DP rank has an unfinished row: one all-reduce per step,
  which also carries "did any rank fail?" (nano_eval.agreement; so does one before every scoring batch and prefill).

Dense models never come here (no extra collectives, no padding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nano_eval.backends.base import Batch
from nano_eval.parallel import ParallelLayout
from nano_eval.rows import ARGMAX, PAD, Row


def scoring_plan(batches: Sequence[Sequence[Row]], layout: ParallelLayout) -> list[tuple[int, int]]:
    """This rank's loglikelihood batches -> the agreed (rows, columns) of every batch index, the same on every DP
    rank (one all_gather_object over the DP group; see agree_scoring)."""
    return agree_scoring(gather_shapes([(len(rows), max(r.input_len for r in rows)) for rows in batches], layout))


def generation_plan(batches: Sequence[Sequence[Row]], layout: ParallelLayout) -> list[tuple[int, int, int]]:
    """This rank's generation batches -> the agreed (rows, prompt width, max new tokens) of every batch index, the
    same on every DP rank (one all_gather_object over the DP group; see agree_generation)."""
    local = [(len(rows), max(len(r.segments[0].context) for r in rows), rows[0].generation.max_new_tokens)
             for rows in batches]
    return agree_generation(gather_shapes(local, layout))


def gather_shapes(shapes: list[tuple[int, ...]], layout: ParallelLayout) -> list[list[tuple[int, ...]]]:
    """Every DP rank's list of batch shapes -> [batch index][DP rank]: that rank's shape of its batch there (zeros
    where it has fewer batches), as many indices as the rank with the most batches."""
    every: list = [list(shapes)]
    if layout.dp_size > 1:
        every = [None] * layout.dp_size
        dist.all_gather_object(every, list(shapes), group=layout.dp_group)
    count, zero = max(len(s) for s in every), (0,) * max((len(x) for s in every for x in s), default=0)
    return [[tuple(s[i]) if i < len(s) else zero for s in every] for i in range(count)]


def agree_scoring(every: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """[batch index][rank] (rows, columns) -> per index the most rows and columns of any rank."""
    return [(max(s[0] for s in at), max(s[1] for s in at)) for at in every]


def agree_generation(every: list[list[tuple[int, int, int]]]) -> list[tuple[int, int, int]]:
    """[batch index][rank] (rows, longest prompt, max new tokens) -> per index (rows, width, steps): the widest
    prompt and most steps of any rank, and the most rows any rank needs: its own plus one filler prompt when its
    longest prompt is narrower than the width (see Lockstep.of)."""
    plan = []
    for at in every:
        width = max(s[1] for s in at)
        plan.append((max(s[0] + (s[1] < width) for s in at), width, max(s[2] for s in at)))
    return plan


def padded_batch(batch: Batch | None, rows: int, columns: int, pad_id: int) -> Batch:
    """`batch` [B, S] -> [rows, columns] with padding rows at the bottom and padding columns on the right (rows,
    cols, targets unchanged); None -> a dummy batch of padding scoring position (0, 0) (its logits are dropped)."""
    if batch is None:
        ids = torch.full((rows, columns), pad_id, dtype=torch.int64)
        one = torch.zeros(1, dtype=torch.int64)
        return Batch(ids, torch.zeros_like(ids), one, one, torch.full((1,), ARGMAX, dtype=torch.int64))
    b, s = batch.input_ids.shape
    if (b, s) == (rows, columns):
        return batch
    grow = (0, columns - s, 0, rows - b)
    out = Batch(F.pad(batch.input_ids, grow, value=pad_id), F.pad(batch.attention_mask, grow, value=0),
                batch.rows, batch.cols, batch.targets)
    if batch.position_ids is not None:  # packed rows: padding is its own segment
        out.position_ids, out.segment_ids = F.pad(batch.position_ids, grow), F.pad(batch.segment_ids, grow, value=PAD)
        out.branch_ids = F.pad(batch.branch_ids, grow)
    return out


@dataclass(frozen=True)
class Lockstep:
    """What one generation batch needs to run in lockstep with the other DP ranks (nano_eval.generate.greedy_decode).

    fillers: prompts decoded after the batch's own, results dropped; max_new_tokens: the most steps any rank decodes
    in this batch (the cache is sized for it)."""

    fillers: list[list[int]]
    max_new_tokens: int
    layout: ParallelLayout

    @classmethod
    def of(cls, rows: Sequence[Row], agreed: tuple[int, int, int], pad_id: int, layout: ParallelLayout) -> Lockstep:
        """The lockstep of a generation batch of `rows` ([] on a rank without this batch) whose agreed shape is
        (rows, width, steps): one filler as wide as the widest prompt of any rank when this rank's are narrower,
        one-token fillers for the rows still missing."""
        count, width, steps = agreed
        longest = max((len(r.segments[0].context) for r in rows), default=0)
        fillers = [[pad_id] * width] if longest < width else []
        fillers += [[pad_id]] * (count - len(rows) - len(fillers))
        return cls(fillers, steps, layout)
