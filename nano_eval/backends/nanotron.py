"""Nanotron backend: score the model object the trainer holds, in its own TP x PP x DP layout.

Two model contracts (nano_eval.compat.nanotron.model_family): nanotron's LlamaModel (0.4 and main) and nanotron
main's Qwen2Model (the SmolLM3 code: no-RoPE layers, qkv bias, sliding window, MoE). Inputs enter on the first
pipeline stage (other stages pass TensorPointers, as nanotron's own data loader does); the model's P2P moves
activations between stages; vocab-sharded logits come out of the last stage, where lm_head projects only the
distinct scored positions (nano_eval.backends.nanotron_packed.ScoredHead: Llama `[U, 1, V/tp]`, Qwen2 `[U, V/tp]`
instead of `[S, B, V/tp]` / `[B * S, V/tp]`). Nothing is rebuilt and no full-vocabulary tensor is gathered.

Packed rows (`supports_packed_rows`: a document's context once, its continuations beside it, several documents
per row, a shared few-shot prefix once; nano_eval.packing): the batch's tree mask and position ids reach every
attention layer through nano_eval.backends.nanotron_packed.TreeAttention (RoPE at each token's own position,
attention under the mask), for both families, every TP mode, PP and CP folded into DP.

Padding (plain batches): rows are right-padded, and each is given to the model as ONE causal sequence of length S:
- Llama: an ALL-TRUE mask with positions 0..S-1. nanotron 0.4's Llama training path flattens the padded `[B * S]`
  states and calls flash-attn's varlen kernel with `cu_seqlens` taken from the mask's lengths, so a real padding
  mask makes every row after a padded one read the wrong offsets.
- Qwen2: contiguous position ids 0..S-1 in every row; Qwen2Model starts a document wherever a position is 0, so
  each row is its own document (its own attention span, its own RoPE positions, its own sliding window).
A real token only sees the tokens before it, all real, so its logits are exactly those of the unpadded row (the pad
tokens after it cost compute, not correctness). Under sequence-parallel TP (`tp_mode: REDUCE_SCATTER`) S must
divide by tp: more pad tokens are appended at the end, which by the same argument changes nothing.

Before the first forward, every rank of the world checks the model contract TOGETHER (`_check_contract`: known
model class, context parallelism only for Qwen2, a nanotron whose Qwen2 can run off the first pipeline stage) and
all raise the same error when one rank finds a problem: a stage that raised before sending would otherwise leave
the next stage waiting in its P2P receive for ever.

Context parallelism (nanotron main's Qwen2, cp > 1, e.g. llama3 ring attention): folded into data parallelism
while scoring. The evaluation's data-parallel group is dp x cp (`dp_cp_pg`; results.json's layout says
`cp_in_dp`), every CP rank scores whole rows of its own, and each forward runs under `LocalAttention.applied()`
(nano_eval.compat.nanotron): no ring over the CP group, RoPE from position 0, all restored after the forward.

Greedy generation: `incremental_decoder()` decodes from a KV cache: nanotron 0.4's Llama its own (the inference
`Store` path, nano_eval.backends.nanotron_cache), nanotron main's Qwen2, which has no inference path, nano_eval's
(nano_eval.backends.nanotron_qwen2_cache: the model's own modules one step at a time, TP and PP). It returns None
(the prompt is re-run per token) under tp_mode REDUCE_SCATTER.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from nano_eval.backends.base import Batch, note_rerun_generation
from nano_eval.backends.nanotron_packed import ScoredHead, TreeAttention, tree_of
from nano_eval.backends.nanotron_qwen2_cache import Qwen2Cache
from nano_eval.backends.nanotron_qwen2_cache import unsupported_reason as qwen2_cache_problem
from nano_eval.compat.nanotron import QWEN2, LocalAttention, import_nanotron, model_family, model_inputs, qwen2_pp_bug
from nano_eval.errors import NanoEvalError
from nano_eval.parallel import ParallelLayout


def layout_from_parallel_context(parallel_context, input_pp_rank: int, output_pp_rank: int, device: str) -> ParallelLayout:
    """ParallelLayout view of a nanotron ParallelContext (nanotron's rank order: pp, dp, (cp,) tp). Under context
    parallelism (nanotron main, cp > 1) the data-parallel group is `dp_cp_pg`: dp x cp ranks, each scoring whole
    rows (nano_eval.compat.nanotron.LocalAttention)."""
    pc = parallel_context
    cp = _cp_size(pc)
    dp_group = pc.dp_cp_pg if cp > 1 else pc.dp_pg
    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        dp_rank=dist.get_rank(dp_group), dp_size=dp_group.size(), dp_group=dp_group, cp_size=cp,
        tp_rank=dist.get_rank(pc.tp_pg), tp_size=pc.tp_pg.size(), tp_group=pc.tp_pg,
        pp_rank=dist.get_rank(pc.pp_pg), pp_size=pc.pp_pg.size(), pp_group=pc.pp_pg,
        input_pp_rank=input_pp_rank, output_pp_rank=output_pp_rank,
        device=device,
    )


def _cp_size(parallel_context) -> int:
    """Context-parallel ranks per model replica (nanotron 0.4's ParallelContext has none: 1)."""
    return getattr(parallel_context, "context_parallel_size", 1) or 1


def _stage_ranks(model) -> tuple[int, int]:
    """First and last pipeline rank among the model's PipelineBlocks."""
    from nanotron.parallel.pipeline_parallel.block import PipelineBlock

    ranks = [m.rank for m in model.modules() if isinstance(m, PipelineBlock)]
    return (min(ranks), max(ranks)) if ranks else (0, 0)


def _contract_problem(model, parallel_context) -> str | None:
    """What keeps this rank from scoring `model` (None when nothing does); depends on the model's class, the
    installed nanotron and the layout, so every rank of a healthy setup gets the same answer."""
    family = model_family(model)
    if family is None:
        return (f"the nanotron backend scores nanotron's LlamaModel (nanotron 0.4 or main) or Qwen2Model (nanotron "
                f"main), not {type(model).__module__}.{type(model).__name__}. Fix: train one of those classes, or "
                "score a saved checkpoint with --backend transformers")
    cp = _cp_size(parallel_context)
    if cp != 1 and family != QWEN2:
        return (f"context parallelism (cp={cp}) is supported by the nanotron backend for nanotron main's Qwen2Model "
                "only (its LlamaModel has no context-parallel attention). Fix: score the checkpoint with cp=1 "
                "(run.py --backend nanotron --tp/--pp)")
    if family == QWEN2 and parallel_context.pp_pg.size() > 1 and qwen2_pp_bug():
        return (f"nanotron main's Qwen2Model cannot run with pipeline parallelism (pp={parallel_context.pp_pg.size()}"
                "): its forward calls position_ids.numel() on a TensorPointer off the first stage (upstream bug in "
                "nanotron 2411b022; its trainer fails the same way). Fix: pp=1, or a nanotron with that bug fixed")
    return None


def _check_contract(model, parallel_context) -> str:
    """The model's family, once every rank of the model's world (parallel_context.world_pg) agrees it can be
    scored; otherwise every rank raises the same NanoEvalError naming the first (global) rank that cannot, so no
    stage is left waiting for another."""
    problem = _contract_problem(model, parallel_context)
    group = getattr(parallel_context, "world_pg", None)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        problems = [None] * dist.get_world_size(group)
        dist.all_gather_object(problems, problem, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(problems))
        ranked = [(rank, p) for rank, p in zip(ranks, problems) if p is not None]
        if ranked:
            rank, problem = ranked[0]
            raise NanoEvalError(f"[rank {rank}] {problem}.")
    elif problem is not None:
        raise NanoEvalError(f"{problem}.")
    return model_family(model)


class NanotronModel:
    """A nanotron model behind the backend protocol (nano_eval.backends.base.Backend).

    `model` is the trainer's model as is: `LlamaForTraining` / `Qwen2ForTraining` (we call its `.model`), or the
    LlamaModel / Qwen2Model itself. Every rank of the world must construct it (the contract check is collective).
    """

    def __init__(self, model, parallel_context, tokenizer, *, max_length: int, device: str | torch.device = "cpu"):
        import_nanotron()
        self.module = model
        self.forward_module = getattr(model, "model", model)  # *ForTraining wraps the model (+ loss)
        self.family = _check_contract(self.forward_module, parallel_context)
        self.tokenizer, self.max_length = tokenizer, max_length
        self.vocab_size = getattr(getattr(self.forward_module, "config", None), "vocab_size", None)
        self.device = torch.device(device)
        first, last = _stage_ranks(self.forward_module)
        sequence_parallel = getattr(getattr(self.forward_module, "tp_mode", None), "name", "") == "REDUCE_SCATTER"
        self.seq_multiple = parallel_context.tp_pg.size() if sequence_parallel else 1
        self.layout = layout_from_parallel_context(parallel_context, first, last, "cuda" if self.device.type == "cuda" else "cpu")
        # cp > 1: the ring attention is off while scoring (each CP rank scores whole rows as a data-parallel rank)
        self.local_attention = None
        if self.layout.cp_size > 1:
            self.local_attention = LocalAttention(self.forward_module, parallel_context)
        # packed rows (a document's context once; nano_eval.packing) under our tree mask and per-token RoPE
        # positions, and lm_head on the scored positions only (nano_eval.backends.nanotron_packed)
        self.supports_packed_rows = True
        self.tree = TreeAttention(self.forward_module, self.family)
        self.head = ScoredHead(self.forward_module, self.family, parallel_context.tp_pg, sequence_parallel)

    def incremental_decoder(self, shared_prefix_tokens: int = 0):
        """Greedy generation from a KV cache behind nano_eval.decoder.CacheDecoder: nanotron 0.4's Llama inference
        Store (nano_eval.backends.nanotron_cache; no shared prefix) or, for nanotron main's Qwen2, which has no
        inference path, nano_eval's own cache over the model's modules (nano_eval.backends.nanotron_qwen2_cache).
        None (generation re-runs the prompt for every token) where the cache cannot serve the model exactly, e.g.
        under tp_mode REDUCE_SCATTER."""
        from nano_eval.decoder import CacheDecoder

        if self.family == QWEN2:
            reason = qwen2_cache_problem(self)
            if reason is None:
                return CacheDecoder(lambda: Qwen2Cache(self), shared_prefix_tokens)
        else:
            from nano_eval.backends.nanotron_cache import StoreCache, unsupported_reason

            reason = unsupported_reason(self)
            if reason is None:
                return CacheDecoder(lambda: StoreCache(self), shared_prefix_tokens)
        note_rerun_generation(self, reason)
        return None

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [N, V/tp] at (batch.rows, batch.cols) on the last stage; None on the other stages."""
        from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

        lay = self.layout
        rows, columns = batch.input_ids.shape
        columns += -columns % self.seq_multiple  # sequence-parallel TP: a multiple of tp (more right padding)
        # see the module docstring: one causal sequence per row, or a packed row's tree (on every stage)
        tree, position_ids = contextlib.nullcontext(), torch.arange(columns, device=self.device).repeat(rows, 1)
        if batch.position_ids is not None:
            mask, position_ids = (t.to(self.device) for t in tree_of(batch, columns))
            tree = self.tree.applied(mask, position_ids)
        if lay.pp_rank == lay.input_pp_rank:
            input_ids = torch.nn.functional.pad(batch.input_ids.to(self.device), (0, columns - batch.input_ids.shape[1]))
        else:
            input_ids = position_ids = TensorPointer(group_rank=lay.input_pp_rank)
        picks = (batch.rows.to(self.device), batch.cols.to(self.device))
        with (self.local_attention.applied() if self.local_attention else contextlib.nullcontext()), tree, \
                self.head.applied(*picks, rows):
            logits = self.forward_module(**model_inputs(self.family, input_ids, position_ids))
        if isinstance(logits, dict):
            logits = logits.get("logits", logits.get("sharded_logits"))
        if not lay.is_output_stage or isinstance(logits, TensorPointer):
            return None
        return self.head.scored(logits)  # [N, V/tp]
