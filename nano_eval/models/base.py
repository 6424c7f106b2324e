"""The backend protocol: the only thing a model framework has to provide to nano_eval.

A backend answers three questions: what is the parallel layout, how does a batch go in, and where do the
vocab-sharded logits come out. Everything else (tokenising, batching, scoring, gathering) is shared.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nano_eval.parallel import ParallelLayout


@dataclass
class Batch:
    """A right-padded batch plus the positions whose next-token logits we need.

    input_ids:      [B, S] int64, identical on every rank of one model replica (all TP and PP ranks)
    attention_mask: [B, S] int64, 1 on real tokens
    rows, cols:     [N] int64: the logits at (rows[k], cols[k]) predict token targets[k]
    targets:        [N] int64 global vocabulary ids (-1 where only the argmax is wanted, e.g. generation)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


class Backend(Protocol):
    """What the scoring core needs from a model."""

    layout: ParallelLayout
    tokenizer: Any
    max_length: int  # longest input the model accepts

    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [N, V/tp] at (batch.rows, batch.cols), any float dtype, on the output pipeline stage; None elsewhere.

        Called by every rank of the model replica with the same batch, under torch.no_grad and eval mode.
        """
        ...
