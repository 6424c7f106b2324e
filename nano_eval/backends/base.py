"""The backend protocol: the only thing a model framework has to provide to nano_eval.

A backend answers three questions: what is the parallel layout, how does a batch go in, and where do the
vocab-sharded logits come out. Everything else (tokenising, batching, scoring, gathering) is shared.
"""

from __future__ import annotations

import contextlib
import random
import sys
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from nano_eval.parallel import ParallelLayout


@dataclass
class Batch:
    """A right-padded batch plus the positions whose next-token logits we need.

    input_ids:      [B, S] int64, identical on every rank of one model replica (all TP and PP ranks)
    attention_mask: [B, S] int64, 1 on real tokens
    rows, cols:     [N] int64: the logits at (rows[k], cols[k]) predict token targets[k]
    targets:        [N] int64 global vocabulary ids (-1 where only the argmax is wanted, e.g. generation)

    Optional, only sent to backends that declare `supports_packed_rows = True` (see nano_eval.packing); when None
    the batch is plain causal rows with positions 0..n-1:
    position_ids:   [B, S] int64 position of each token within its document / continuation
    segment_ids:    [B, S] int64 document of each token within its row (-1 on padding)
    branch_ids:     [B, S] int64 0 on a document's shared context, k on its k-th continuation
    Token i attends token j iff j <= i, same segment, and branch_ids[j] in (0, branch_ids[i]).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor
    position_ids: torch.Tensor | None = None
    segment_ids: torch.Tensor | None = None
    branch_ids: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


class Backend(Protocol):
    """What the scoring core needs from a model."""

    layout: ParallelLayout
    tokenizer: Any
    max_length: int  # longest input the model accepts
    module: torch.nn.Module  # the model object; put in eval mode during scoring and restored afterwards
    # Optional: vocab_size, the model's embedding rows (the full vocabulary, also under TP). Token ids at or past it
    # are refused before any forward, and a pad id past it is replaced; absent or None: not checked.

    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [N, V/tp] at (batch.rows, batch.cols), any float dtype, on the output pipeline stage; None elsewhere.

        Called by every rank of the model replica with the same batch, under torch.no_grad and eval mode.
        """
        ...


@contextlib.contextmanager
def scoring_session(backend):
    """A backend's setup for a whole run of forwards, when it has one (`backend.session()`: torchtitan's FSDP2
    parameters gathered once and resharded after). Every rank enters it together."""
    session = getattr(backend, "session", None)
    with session() if session is not None else contextlib.nullcontext():
        yield


def note_rerun_generation(backend, reason: str) -> None:
    """Say once per backend, on global rank 0, that greedy generation re-runs the prompt for every new token."""
    if getattr(backend, "_noted_rerun", False):
        return
    backend._noted_rerun = True
    if backend.layout.is_main:
        print(f"nano_eval: note: {type(backend).__name__} generates without a KV cache ({reason}): every new token "
              "re-runs the prompt, so generation costs prompt x answer tokens.", file=sys.stderr)


@contextlib.contextmanager
def evaluation_mode(module: torch.nn.Module | None):
    """Score a live training model without changing it: eval mode and no_grad inside; afterwards every submodule's
    train/eval flag and every RNG state (python, numpy, torch CPU and CUDA) are back as they were."""
    flags = [(m, m.training) for m in module.modules()] if module is not None else []
    rng = _rng_states()
    try:
        if module is not None:
            module.eval()
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.training = training
        _restore_rng_states(rng)


def _rng_states() -> dict:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _restore_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])
