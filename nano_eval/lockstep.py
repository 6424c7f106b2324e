"""Lockstep forwards: every data-parallel rank runs the same number of forwards with the same shapes.

For models whose forward holds collectives across data-parallel ranks (a backend with `lockstep = True`: MoE layers
under expert parallelism, whose token dispatch is an all-to-all or all-gather over the expert-parallel group). Each
DP rank cuts its own batches, so without this one rank would wait in its extra forward's first MoE layer until the
process group's timeout; the all-gather dispatcher also needs the same token count on every rank.

- Once per run, one all_gather_object over the DP group of each rank's batch shapes (`plan_scoring`,
  `plan_generation`): batch i gets, on every rank, the largest shape any rank has for it (generation batches
  are matched by their settings first), ranks with fewer batches run dummy ones, and an agreed shape over
  `--batch-tokens` is cut into several forwards (`split_rows`), so no forward carries more padded positions than
  the budget (a single row longer than the budget alone, as without lockstep).
- Scoring: each batch is padded to its agreed [rows, columns] with padding rows and right-padding columns
  (`padded_batch`: the scored positions stay where they are; causal attention and dropless routing keep padding
  out of them); a dummy batch is all padding with one scored position whose logits are dropped.
- Generation (`Lockstep`): batch i has as many rows (one-token filler prompts) and as wide a left-padded prompt
  block (the agreed width) on every rank, finished rows keep decoding (their tokens are dropped), and decoding goes
  on until no DP rank has an unfinished row: one all-reduce per step, which also carries "did any rank fail?"
  (nano_eval.agreement; so does one before every scoring batch and prefill).

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


@dataclass(frozen=True)
class Step:
    """One lockstep forward (scoring) or decode (generation), the same on every DP rank: its agreed shape, and
    which rows each rank puts in: rows [start, start + shape[0]) of its batch `batch[rank]` (None: none, a dummy)."""

    shape: tuple[int, ...]  # (rows, columns) or (rows, prompt width, steps)
    start: int
    batch: tuple[int | None, ...]  # per DP rank


def plan_scoring(every: list[list[tuple[int, int]]], max_tokens: int) -> list[Step]:
    """[rank][batch] (rows, longest row) -> the steps: batch i of every rank together, padded to the most rows and
    columns of any rank, cut to `max_tokens` (`split_rows`)."""
    steps = []
    for i in range(max(map(len, every), default=0)):
        at = [shapes[i] if i < len(shapes) else (0, 0) for shapes in every]
        count, columns = max(s[0] for s in at), max(s[1] for s in at)
        here = tuple(i if i < len(shapes) else None for shapes in every)
        steps += [Step((n, columns), start, here) for start, n in split_rows(count, columns, max_tokens)]
    return steps


def plan_generation(every: list[list[tuple]], max_tokens: int) -> list[Step]:
    """[rank][batch] (settings key, rows, longest prompt, max new tokens) -> the steps: batches are matched by their
    settings first (the i-th batch of one setting on every rank; settings in sorted order), padded to the most rows,
    widest prompt and most steps of any rank, and cut so rows x (width + steps) stays within `max_tokens`. Matching
    by position alone paired one rank's many short prompts with another's long ones (3,520 positions per forward at
    a budget of 300)."""
    steps = []
    for key in sorted({shape[0] for shapes in every for shape in shapes}):
        mine = [[b for b, shape in enumerate(shapes) if shape[0] == key] for shapes in every]  # per rank
        for i in range(max(map(len, mine))):
            here = tuple(m[i] if i < len(m) else None for m in mine)
            at = [every[r][b][1:] for r, b in enumerate(here) if b is not None]
            count, width, new = max(s[0] for s in at), max(s[1] for s in at), max(s[2] for s in at)
            steps += [Step((n, width, new), start, here) for start, n in split_rows(count, width + new, max_tokens)]
    return steps


def split_rows(rows: int, columns: int, max_tokens: int) -> list[tuple[int, int]]:
    """(first row, rows) of the forwards that run an agreed batch of `rows` x `columns` within `max_tokens`: one
    forward when it fits, else as few as fit (a row wider than the budget alone)."""
    per = max(1, max_tokens // max(1, columns))
    return [(start, min(per, rows - start)) for start in range(0, rows, per)] if rows > per else [(0, rows)]


def scoring_schedule(batches: Sequence[Sequence[Row]], layout: ParallelLayout,
                     max_tokens: int) -> list[tuple[list[Row], tuple[int, int]]]:
    """This rank's loglikelihood batches -> its lockstep forwards (its rows, the agreed [rows, columns]): the same
    count and shapes on every DP rank (`plan_scoring`; one all_gather_object over the DP group)."""
    every = _gather([(len(rows), max(r.input_len for r in rows)) for rows in batches], layout)
    return _mine(plan_scoring(every, max_tokens), batches, layout)


def generation_schedule(batches: Sequence[Sequence[Row]], layout: ParallelLayout,
                        max_tokens: int) -> list[tuple[list[Row], tuple[int, int, int]]]:
    """This rank's generation batches -> its lockstep decodes (its rows, the agreed (rows, prompt width, steps)):
    the same on every DP rank (`plan_generation`; one all_gather_object over the DP group)."""
    local = []
    for rows in batches:
        g = rows[0].generation
        local.append(((g.max_new_tokens, tuple(g.stop)), len(rows), max(len(r.segments[0].context) for r in rows),
                      g.max_new_tokens))
    return _mine(plan_generation(_gather(local, layout), max_tokens), batches, layout)


def _gather(local: list, layout: ParallelLayout) -> list[list]:
    """[rank] -> that rank's `local` (one all_gather_object over the DP group)."""
    if layout.dp_size == 1:
        return [local]
    every: list = [None] * layout.dp_size
    dist.all_gather_object(every, local, group=layout.dp_group)
    return every


def _mine(steps: list[Step], batches: Sequence[Sequence[Row]], layout: ParallelLayout) -> list[tuple[list, tuple]]:
    """The rows this DP rank puts into each step, with the step's shape."""
    rank = layout.dp_rank if layout.dp_size > 1 else 0
    out = []
    for step in steps:
        b = step.batch[rank]
        rows = [] if b is None else list(batches[b][step.start:step.start + step.shape[0]])
        out.append((rows, step.shape))
    return out


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

    fillers: one-token prompts decoded after the batch's own (results dropped) up to the agreed row count;
    width: the agreed prompt width (every rank's prompts are left-padded to it); max_new_tokens: the most steps
    any rank decodes in this batch (the cache is sized for it)."""

    fillers: list[list[int]]
    width: int
    max_new_tokens: int
    layout: ParallelLayout

    @classmethod
    def of(cls, rows: Sequence[Row], agreed: tuple[int, int, int], pad_id: int, layout: ParallelLayout) -> Lockstep:
        """The lockstep of a generation batch of `rows` ([] on a rank without this batch) whose agreed shape is
        (rows, width, steps)."""
        count, width, steps = agreed
        return cls([[pad_id]] * (count - len(rows)), width, steps, layout)
