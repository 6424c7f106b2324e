"""Failing together: a fault on one rank ends the evaluation on every rank at the next point where ranks meet.

A rank that raises outside a forward (reading a document, detokenising, a stop sequence, a metric, writing) must not
leave its peers waiting in a collective until the process group's timeout (with NCCL ten minutes, after which the
watchdog ends the process: one rank's bad document would kill the training run). So an evaluation runs its local
work under `Agreement.guard()`: an exception is kept instead of raised, the rank stops contributing work but goes on
meeting its peers, and every meeting point carries "did anyone fail?":

- `meet(unfinished)`, before every forward of a loop (a scoring batch, every generation step): one all-reduce (MAX)
  of [unfinished, failed] over the ranks that run the same forwards: every rank under lockstep (nano_eval.lockstep;
  it replaces lockstep's "is any rank unfinished?" all-reduce, and carries each DP rank's numbers for the next
  generation step's shape), else the model replica (its TP group, then its PP group). A dense model without model parallelism has no such collective: its
  failing rank just leaves its loop, and the ranks meet at `settle`.
- `settle()` (`raise_together`), at the end of a run, before its results are gathered (and around the command
  line's load, build and write): one all-reduce of the flag over every rank of the evaluation and, only when a rank
  failed, one all_gather_object of the messages; then every rank raises the same EvaluationFailed naming the failing
  ranks, and every collective that was started has been matched: the process groups stay usable (the training hook
  returns None under fail_soft and training goes on).

A fault inside a forward (out of memory halfway through a tensor-parallel all-reduce, a kernel failing on one rank)
leaves the peers inside that collective: no evaluator can recover from that; the process group's timeout ends it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from nano_eval.errors import EvaluationFailed, NanoEvalError
from nano_eval.parallel import ParallelLayout, all_reduce, any_rank_true


class Agreement:
    """One run's fault flag and meeting points (see the module docstring). Every rank of the evaluation builds one
    per run and calls `meet` at the same points as its peers (lockstep: every rank; otherwise: the replica's ranks)
    and `settle` once at the end."""

    def __init__(self, layout: ParallelLayout, lockstep: bool = False):
        self.layout, self.lockstep = layout, lockstep
        self.error: Exception | None = None  # this rank's first fault
        self.stopped = False  # a rank this one meets has failed: leave every loop
        self.numbers: list[list[int]] = []  # every DP rank's numbers at the last `meet` (see there)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run the body; an Exception is kept (the first one) instead of raised. The caller goes on to its next
        `meet`, which stops every rank."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 -- raised on every rank by settle()
            self.error = self.error or e

    def meet(self, unfinished: bool = True, numbers: Sequence[int] = ()) -> bool:
        """Go on? True while some rank this one meets is `unfinished` and none has failed; sets `stopped` when one
        failed. No collective once stopped (every rank that meets this one learnt it at the same call).

        numbers: this rank's non-negative ints for the next step's plan (nano_eval.generate: continuous batching);
        afterwards `self.numbers` [DP rank][i] holds every DP rank's under lockstep (carried by the same all-reduce:
        each DP rank fills its own slice), else [this rank's] (the replica's ranks hold the same ones)."""
        if self.stopped:
            return False
        lay = self.layout
        ranks = lay.dp_size if self.lockstep else 1
        flags = torch.zeros(2 + ranks * len(numbers), dtype=torch.int64)
        flags[0], flags[1] = int(unfinished), int(self.error is not None)
        own = 2 + (lay.dp_rank if self.lockstep else 0) * len(numbers)
        flags[own:own + len(numbers)] = torch.tensor(list(numbers), dtype=torch.int64)
        flags = flags.to(lay.device)
        if self.lockstep:
            all_reduce(flags, dist.ReduceOp.MAX, None, lay.world_size)
        else:
            all_reduce(flags, dist.ReduceOp.MAX, lay.tp_group, lay.tp_size)
            all_reduce(flags, dist.ReduceOp.MAX, lay.pp_group, lay.pp_size)
        values = flags.tolist()
        unfinished, self.stopped = values[0], bool(values[1])
        self.numbers = [values[2 + r * len(numbers):2 + (r + 1) * len(numbers)] for r in range(ranks)]
        return bool(unfinished) and not self.stopped

    def settle(self) -> None:
        """Collective over every rank: raise the same EvaluationFailed on every rank if any rank failed."""
        raise_together(self.error, self.layout.world_size, self.layout.device)


def raise_together(error: Exception | None, world: int | None = None, device: str | None = None) -> None:
    """Every rank of the evaluation (the default process group; `world` and `device` default to its size and its
    backend's device) passes its own error or None; if any rank passed one, every rank raises the same
    EvaluationFailed (from its own error; a single process raises its error itself). One int all-reduce, plus one
    all_gather_object of the messages when a rank failed."""
    if world is None:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        device = "cuda" if world > 1 and dist.get_backend() == "nccl" else "cpu"
    if world == 1 or (error is not None and broken_group(error)):
        if error is not None:
            raise error  # one process, or a collective that failed: no agreement to be had
        return
    mine = None if error is None else (message_of(error), getattr(error, "exit_code", 1))
    if not any_rank_true(mine is not None, None, world, device or "cpu"):
        return
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    failures = [(rank, p[0]) for rank, p in enumerate(parts) if p is not None]
    raise EvaluationFailed(failures, exit_code=next(p[1] for p in parts if p is not None)) from error


def broken_group(error: BaseException) -> bool:
    """A collective itself failed (a peer did not answer within the timeout, a connection closed): the process group
    can carry no agreement."""
    text = str(error).lower()
    return isinstance(error, dist.DistError) or ("gloo" in text and ("timed out" in text or "connection" in text))


def message_of(error: BaseException, limit: int = 1000) -> str:
    """One line: a NanoEvalError's own message (it names the thing and the fix); `Type: message` for anything
    else."""
    text = " ".join(str(error).split())
    if not isinstance(error, NanoEvalError):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
