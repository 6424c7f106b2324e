"""Megatron-Core backend: score the model chunks the trainer holds, in their own TP x PP x DP layout.

The model is a `GPTModel` built with `parallel_output=True` (Megatron's default), or the list of chunks that
`pretrain` holds (wrapped in DDP / Float16Module), or anything with the same call convention:
`model(input_ids [B, S], position_ids [B, S], attention_mask [1, 1, S, S] bool, True = masked)` returning
vocab-sharded logits `[B, S, V/tp]` on the last pipeline stage.

- pp = 1: we call the model directly and keep the scored positions of its logits.
- pp > 1 (GPU only): Megatron's own schedule (`get_forward_backward_func()`, forward_only=True,
  collect_non_loss_data=True) moves activations between stages; the forward step's "loss function" returns the
  scored-position logits as non-loss data on the last stage. Every stage holds the same batch, so the schedule is
  told the batch's real sequence length (no variable_seq_lengths needed); `pad_to_length` fixes it instead.
Rows are right-padded, so a causal mask alone keeps padding out of every scored position.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from nano_eval.backends.base import Batch
from nano_eval.compat.megatron import call_schedule, layout_from_megatron, unwrap
from nano_eval.errors import NanoEvalError


class MegatronModel:
    """Megatron model chunks behind the backend protocol (nano_eval.backends.base.Backend)."""

    def __init__(self, model, tokenizer, *, max_length: int, device: str | torch.device | None = None,
                 pg_collection=None, micro_batch_size: int | None = None, pad_to_length: int | None = None):
        """model: a GPTModel or the trainer's list of chunks. micro_batch_size (pp > 1): rows per microbatch in the
        schedule (default: the whole batch in one). pad_to_length: pad every batch to this many tokens (static
        shapes, e.g. CUDA graphs); default: each batch's own length."""
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        self.module = torch.nn.ModuleList(self.chunks)  # eval mode / no_grad are applied to every chunk
        self.tokenizer, self.max_length = tokenizer, max_length
        self.micro_batch_size, self.pad_to_length = micro_batch_size, pad_to_length
        first = next(self.chunks[0].parameters())
        self.device = torch.device(device) if device is not None else first.device
        self.layout = layout_from_megatron(pg_collection, "cuda" if self.device.type == "cuda" else "cpu")
        inner = unwrap(self.chunks[-1])
        if self.layout.tp_size > 1 and getattr(inner, "parallel_output", True) is False:
            raise NanoEvalError(
                "the Megatron model was built with parallel_output=False: every TP rank would hold full-vocabulary "
                "logits. Fix: build GPTModel(..., parallel_output=True) (Megatron's default)."
            )
        self.config = getattr(inner, "config", None)
        self.seq_multiple = self.layout.tp_size if getattr(self.config, "sequence_parallel", False) else 1

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [N, V/tp] at (batch.rows, batch.cols) on the last stage; None on the other stages."""
        input_ids = self._padded(batch.input_ids.to(self.device))
        rows, cols = batch.rows.to(self.device), batch.cols.to(self.device)
        if self.layout.pp_size == 1 and len(self.chunks) == 1:
            logits = self.chunks[0](*self._inputs(input_ids))  # [B, S, V/tp]
            return logits[rows, cols]
        return self._forward_pipelined(input_ids, rows, cols)

    def _padded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] -> [B, S'] with S' = pad_to_length, or S rounded up for sequence parallelism."""
        s = input_ids.shape[1]
        target = self.pad_to_length or math.ceil(s / self.seq_multiple) * self.seq_multiple
        if target < s:
            raise NanoEvalError(f"a batch of {s} tokens is longer than pad_to_length={self.pad_to_length}. "
                                f"Fix: set max_length <= pad_to_length (now {self.max_length}).")
        return F.pad(input_ids, (0, target - s), value=self.tokenizer.pad_token_id or 0)

    @staticmethod
    def _inputs(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """GPTModel's (input_ids, position_ids, attention_mask): positions 0.. per row, causal mask True above
        the diagonal (masked), as Megatron's get_ltor_masks_and_position_ids builds them."""
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        mask = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
        return input_ids, position_ids, mask

    # ---- pipeline parallel (GPU only: Megatron's P2P allocates on CUDA) -------------------------------------------

    def _forward_pipelined(self, input_ids, rows, cols) -> torch.Tensor | None:
        """Run the batch through Megatron's schedule in microbatches of `micro_batch_size` rows."""
        b, s = input_ids.shape
        mbs = min(self.micro_batch_size or b, b)
        n_micro = math.ceil(b / mbs)
        if len(self.chunks) > 1:  # the interleaved schedule wants a multiple of pp microbatches
            n_micro = math.ceil(n_micro / self.layout.pp_size) * self.layout.pp_size
        input_ids = F.pad(input_ids, (0, 0, 0, n_micro * mbs - b), value=self.tokenizer.pad_token_id or 0)
        picks = [torch.nonzero(rows // mbs == m).squeeze(-1) for m in range(n_micro)]
        micro = [(input_ids[m * mbs:(m + 1) * mbs], rows[p] - m * mbs, cols[p]) for m, p in enumerate(picks)]

        def forward_step(data_iterator, model):
            ids, r, c = next(data_iterator)
            output = model(*self._inputs(ids))  # [mbs, S, V/tp] on the last stage, hidden states elsewhere

            def scored_logits(output_tensor, non_loss_data=False):
                return output_tensor[r, c]

            return output, scored_logits

        iterators = [iter(micro) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro)
        collected = call_schedule(forward_step, iterators, self.chunks, num_microbatches=n_micro, seq_length=s,
                                  micro_batch_size=mbs)
        if not self.layout.is_output_stage:
            return None
        out = torch.empty(rows.numel(), collected[0].shape[-1], dtype=collected[0].dtype, device=collected[0].device)
        for p, logits in zip(picks, collected, strict=True):
            out[p] = logits
        return out
