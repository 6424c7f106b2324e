"""Nanotron backend: score the model object the trainer holds, in its own TP x PP x DP layout.

Inputs enter on the first pipeline stage (other stages pass TensorPointers, as nanotron's own data loader does);
the model's P2P moves activations between stages; vocab-sharded logits `[S, B, V/tp]` come out of the last
stage, where we keep only the scored positions. Nothing is rebuilt and no full-vocabulary tensor is gathered.

Padding: batches are right-padded, and the model is given an ALL-TRUE mask with positions 0..S-1. nanotron 0.4's
Llama training path flattens the padded `[B * S]` states and calls flash-attn's varlen kernel with `cu_seqlens`
taken from the mask's lengths, so a real padding mask makes every row after a padded one read the wrong
offsets. With an all-true mask each row is one causal sequence of length S: a real token only sees the tokens
before it, all real, so its logits are exactly those of the unpadded row (the pad tokens after it cost compute,
not correctness). Under sequence-parallel TP (`tp_mode: REDUCE_SCATTER`) S must divide by tp: more pad tokens
are appended at the end, which by the same argument changes nothing.

Greedy generation: `incremental_decoder()` decodes from nanotron's own KV cache (its inference `Store` path,
nano_eval.backends.nanotron_cache), or returns None under tp_mode REDUCE_SCATTER (the prompt is then re-run per
token).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from nano_eval.backends.base import Batch, note_rerun_generation
from nano_eval.compat.nanotron import forward_kwargs, import_nanotron
from nano_eval.parallel import ParallelLayout


def layout_from_parallel_context(parallel_context, input_pp_rank: int, output_pp_rank: int, device: str) -> ParallelLayout:
    """ParallelLayout view of a nanotron ParallelContext (nanotron's rank order: pp, dp, tp)."""
    pc = parallel_context
    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        dp_rank=dist.get_rank(pc.dp_pg), dp_size=pc.dp_pg.size(), dp_group=pc.dp_pg,
        tp_rank=dist.get_rank(pc.tp_pg), tp_size=pc.tp_pg.size(), tp_group=pc.tp_pg,
        pp_rank=dist.get_rank(pc.pp_pg), pp_size=pc.pp_pg.size(), pp_group=pc.pp_pg,
        input_pp_rank=input_pp_rank, output_pp_rank=output_pp_rank,
        device=device,
    )


def _stage_ranks(model) -> tuple[int, int]:
    """First and last pipeline rank among the model's PipelineBlocks."""
    from nanotron.parallel.pipeline_parallel.block import PipelineBlock

    ranks = [m.rank for m in model.modules() if isinstance(m, PipelineBlock)]
    return (min(ranks), max(ranks)) if ranks else (0, 0)


class NanotronModel:
    """A nanotron model behind the backend protocol (nano_eval.backends.base.Backend).

    `model` is the trainer's model as is: `LlamaForTraining` (we call its `.model`), nanotron main's Qwen2, or any
    module with the same forward convention returning `[S, B, V/tp]` logits on the last stage.
    """

    def __init__(self, model, parallel_context, tokenizer, *, max_length: int, device: str | torch.device = "cpu"):
        import_nanotron()
        self.module = model
        self.forward_module = getattr(model, "model", model)  # LlamaForTraining wraps LlamaModel (+ loss)
        self.tokenizer, self.max_length = tokenizer, max_length
        self.vocab_size = getattr(getattr(self.forward_module, "config", None), "vocab_size", None)
        self.device = torch.device(device)
        first, last = _stage_ranks(self.forward_module)
        sequence_parallel = getattr(getattr(self.forward_module, "tp_mode", None), "name", "") == "REDUCE_SCATTER"
        self.seq_multiple = parallel_context.tp_pg.size() if sequence_parallel else 1
        self.layout = layout_from_parallel_context(parallel_context, first, last, "cuda" if self.device.type == "cuda" else "cpu")

    def incremental_decoder(self):
        """Greedy generation from nanotron's own KV cache (nano_eval.backends.nanotron_cache), or None (generation
        re-runs the prompt for every token) under tp_mode REDUCE_SCATTER or for a model other than its Llama."""
        from nano_eval.backends.nanotron_cache import StoreDecoder, unsupported_reason

        reason = unsupported_reason(self)
        if reason is None:
            return StoreDecoder(self)
        note_rerun_generation(self, reason)
        return None

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [N, V/tp] at (batch.rows, batch.cols) on the last stage; None on the other stages."""
        from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

        lay = self.layout
        if lay.pp_rank == lay.input_pp_rank:
            input_ids = batch.input_ids.to(self.device)
            extra = -input_ids.shape[1] % self.seq_multiple
            if extra:
                input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=0)
            input_mask = torch.ones_like(input_ids, dtype=torch.bool)  # see the module docstring: exact, not an approximation
            position_ids = torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids)
        else:
            input_ids = input_mask = position_ids = TensorPointer(group_rank=lay.input_pp_rank)
        logits = self.forward_module(**forward_kwargs(self.forward_module, input_ids, input_mask, position_ids))
        if isinstance(logits, dict):
            logits = logits.get("logits", logits.get("sharded_logits"))
        if not lay.is_output_stage or isinstance(logits, TensorPointer):
            return None
        return logits[batch.cols.to(logits.device), batch.rows.to(logits.device)]  # [S, B, V/tp] -> [N, V/tp]
