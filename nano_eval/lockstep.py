"""Lockstep forwards: every data-parallel rank runs the same number of forwards with the same shapes.

For models whose forward holds collectives across data-parallel ranks (a backend with `lockstep = True`: MoE layers
under expert parallelism, whose token dispatch is an all-to-all or all-gather over the expert-parallel group). Each
DP rank cuts its own batches, so without this one rank would wait in its extra forward's first MoE layer until the
process group's timeout; the all-gather dispatcher also needs the same token count on every rank.

- Scoring: once per run, one all_gather_object over the DP group of each rank's batch shapes (`plan_scoring`):
  batch i gets, on every rank, the largest shape any rank has for it, ranks with fewer batches run dummy ones, and
  an agreed shape over `--batch-tokens` is cut into several forwards (`split_rows`), so no forward carries more
  padded positions than the budget (a single row longer than the budget alone, as without lockstep). Each batch is
  padded to its agreed [rows, columns] with padding rows and right-padding columns (`padded_batch`: the scored
  positions stay where they are; causal attention and dropless routing keep padding out of them); a dummy batch is
  all padding with one scored position whose logits are dropped.
- Generation: once per run, one all_gather_object of each rank's generation settings (`generation_pools`): every
  rank decodes one pool per setting, in the same order (an empty one where it has no prompt of that setting). Each
  decoding step's shape is agreed as it comes (nano_eval.generate: continuous batching; the step's all-reduce,
  which also carries "did any rank fail?", nano_eval.agreement): the same rows on every rank (dead slots decode a
  filler token), refill prefills of the same rows and width (one-token filler prompts), until no DP rank has a live
  row or a waiting prompt.

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
    """One lockstep scoring forward, the same on every DP rank: its agreed shape, and which rows each rank puts in:
    rows [start, start + shape[0]) of its batch `batch[rank]` (None: none, a dummy)."""

    shape: tuple[int, ...]  # (rows, columns)
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


def generation_pools(batches: Sequence[Sequence[Row]], layout: ParallelLayout,
                     max_tokens: int) -> list[tuple[list[Row], tuple]]:
    """This rank's generation pools (one per setting: `batches` cut by setting only) -> one pool per setting any DP
    rank has, in the same order on every rank (its rows here, or []), with the setting (one all_gather_object over
    the DP group). `max_tokens` is unused: each step's shape is agreed as it comes (nano_eval.generate)."""
    mine = {_setting(rows): list(rows) for rows in batches if rows}
    keys = sorted({key for keys in _gather(sorted(mine), layout) for key in keys})
    return [(mine.get(key, []), key) for key in keys]


def _setting(rows: Sequence[Row]) -> tuple:
    g = rows[0].generation
    return g.max_new_tokens, tuple(g.stop)


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
