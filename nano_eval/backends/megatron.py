"""Megatron-Core backend: score the model chunks the trainer holds, in their own TP x PP (x virtual PP) x DP layout.

The model is a `GPTModel` built with `parallel_output=True` (Megatron's default), or the list of chunks that
`pretrain` holds (wrapped in DDP / Float16Module), or anything with the same call convention:
`model(input_ids [B, S], position_ids [B, S], attention_mask [1, 1, S, S] bool, True = masked)` returning
vocab-sharded logits `[B, S, V/tp]` on the last pipeline stage.

- Output layer on scored positions only: while we score, a forward pre-hook on the last chunk's `output_layer`
  (a ColumnParallelLinear) hands it the final hidden states `[N, 1, H]` at the scored (row, col) positions instead
  of `[S, B, H]`, so the last stage computes `[N, V/tp]` logits rather than `[B, S, V/tp]` (B x S / N times less;
  the hook is removed after every batch). Under sequence parallelism the hidden states `[S/tp, B, H]` are gathered
  over TP first and the layer's own gather is switched off for that call, as megatron-core's inference does.
  A model without an `output_layer` attribute is called as is and its full logits are indexed.
- pp = 1: we call the model directly.
- pp > 1: Megatron's own schedule (`get_forward_backward_func()`, forward_only=True, collect_non_loss_data=True;
  1F1B, or interleaved when the trainer holds several chunks per stage) moves activations between stages; the
  forward step's "loss function" returns the scored-position logits as non-loss data on the last stage. Every
  stage holds the same batch, so the schedule is told the batch's real sequence length (no variable_seq_lengths
  needed); `pad_to_length` fixes it instead.
Rows are right-padded, so a causal mask alone keeps padding out of every scored position.
- Packed rows (a document's context once, its continuations beside it; nano_eval.packing): with megatron-core's
  local core attention the backend declares `supports_packed_rows` and a packed batch goes in with its tree mask
  `[B, 1, S, S]` and per-row RoPE positions (nano_eval.backends.megatron_packed); otherwise (Transformer Engine,
  sliding windows, ...) it gets plain right-padded rows. All pipeline stages agree on which when the backend is
  built. The output layer projects each scored position once (single-token choices share one).
- Greedy generation: `incremental_decoder()` decodes from megatron-core's static KV cache in the same layout
  (nano_eval.backends.megatron_cache), or returns None where the model cannot (the prompt is then re-run per token).
- Every forward runs under `ScoringState.applied()` (nano_eval.backends.megatron_scoring): MoE layers route
  dropless, their training counters are kept, context parallelism is off (CP ranks score whole rows as
  data-parallel ranks; the schedule is told seq_length x cp, which it divides by cp); all restored after.
- Mixture-of-Experts under expert parallelism: the MoE layers' all-to-all / all-gather spans data-parallel ranks,
  so `lockstep` is True and the engine runs the same number of forwards with the same shapes on every
  data-parallel rank (nano_eval.lockstep).
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from nano_eval.backends.base import Batch, note_rerun_generation
from nano_eval.backends.megatron_packed import TreeForward, packed_rows_problem, tree_inputs
from nano_eval.backends.megatron_scoring import ScoringState
from nano_eval.compat.megatron import call_schedule, layout_from_megatron, unwrap, warn_untested_release
from nano_eval.errors import NanoEvalError
from nano_eval.parallel import any_rank_true


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
        warn_untested_release(self.layout.is_main)  # one line, outside megatron-core 0.16.1 to 0.19.2
        inner = unwrap(self.chunks[-1])
        if self.layout.tp_size > 1 and getattr(inner, "parallel_output", True) is False:
            raise NanoEvalError(
                "the Megatron model was built with parallel_output=False: every TP rank would hold full-vocabulary "
                "logits. Fix: build GPTModel(..., parallel_output=True) (Megatron's default)."
            )
        self.config = getattr(inner, "config", None)
        self.vocab_size = getattr(inner, "vocab_size", None)  # GPTModel's: the padded full vocabulary
        self.seq_multiple = self.layout.tp_size if getattr(self.config, "sequence_parallel", False) else 1
        self.scoring = ScoringState(self.chunks)
        self.layout = dataclasses.replace(self.layout, moe_routing=self.scoring.routing)
        # MoE layers talk over the expert-tensor x expert-parallel group: consecutive ranks, TP first, so it stays
        # inside one model replica only when etp x ep <= tp
        etp = getattr(self.config, "expert_tensor_parallel_size", None) or self.layout.tp_size
        self.lockstep = self.scoring.moe and etp * self.layout.ep_size > self.layout.tp_size
        self._picks: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, cols) of the forward in flight
        self._inverse: torch.Tensor | None = None  # scored position k -> its row of the output layer's input
        self._hooked = False
        # packed rows (tree mask, per-row RoPE) where every stage's chunks take them (one MAX over the pp group)
        problem = packed_rows_problem(self.chunks)
        lay = self.layout
        self.supports_packed_rows = not any_rank_true(problem is not None, lay.pp_group, lay.pp_size, lay.device)
        self.tree = TreeForward(self.chunks) if self.supports_packed_rows else None

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [N, V/tp] at (batch.rows, batch.cols) on the last stage; None on the other stages. A packed
        batch (position / segment / branch ids set) runs under its tree mask (nano_eval.backends.megatron_packed)."""
        rows, cols = batch.rows.to(self.device), batch.cols.to(self.device)
        if batch.position_ids is None:
            return self.run(self._inputs(self._padded(batch.input_ids.to(self.device))), rows, cols)
        if self.tree is None:
            raise NanoEvalError("a packed batch reached a Megatron model that takes no tree mask (nano_eval bug: "
                                "the engine asks supports_packed_rows first). Fix: report it.")
        columns = self._columns(batch.input_ids.shape[1])
        inputs = tuple(t.to(self.device) for t in tree_inputs(batch, columns, self._pad_id))
        with self.tree.applied():
            return self.run(inputs, rows, cols)

    def incremental_decoder(self, shared_prefix_tokens: int = 0):
        """Greedy generation from megatron-core's static KV cache (nano_eval.backends.megatron_cache behind
        nano_eval.decoder.CacheDecoder; no shared prefix), or None (generation re-runs the prompt for every token)
        where the model cannot decode that way exactly."""
        from nano_eval.backends.megatron_cache import StaticCache, unsupported_reason
        from nano_eval.decoder import CacheDecoder

        reason = unsupported_reason(self)  # from this stage's layers: all stages must agree before decoding
        lay = self.layout
        if any_rank_true(reason is not None, lay.pp_group, lay.pp_size, lay.device):
            note_rerun_generation(self, reason or "a model chunk on another pipeline stage")
            return None
        return CacheDecoder(lambda: StaticCache(self), shared_prefix_tokens)

    @torch.no_grad()
    def run(self, inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: torch.Tensor, cols: torch.Tensor,
            context=None) -> torch.Tensor | None:
        """One forward of (input_ids [B, S], position_ids [B, S], attention_mask [1 or B, 1, S, S_k] bool, True =
        masked) through every stage: logits [N, V/tp] at (rows, cols) on the last stage, None elsewhere.
        context: a megatron-core static inference context holding the KV cache; the batch is then split into
        `decode_microbatches` equal microbatches (B must divide), microbatch m in cache rows [m * B/n, (m+1) * B/n)."""
        with self.scoring.applied(), self._output_layer_on_scored_positions():
            if self.layout.pp_size == 1 and len(self.chunks) == 1:
                return self._scored(self.chunks[0], inputs, rows, cols, context)
            return self._forward_pipelined(inputs, rows, cols, context)

    def _scored(self, chunk, inputs, rows, cols, context=None) -> torch.Tensor:
        """One forward of the last (or only) stage: logits [N, V/tp] at (rows, cols)."""
        self._picks = (rows, cols)
        self._set_positions(inputs[1])
        output = _call(chunk, inputs, context)
        return self._at_scored(output, rows, cols, self._inverse)

    def _at_scored(self, output: torch.Tensor, rows, cols, inverse) -> torch.Tensor:
        """The model's output -> logits [N, V/tp] at (rows, cols): [1, U, V/tp] from the hooked output layer (each
        scored position once, `inverse` maps them back to the N picks), else [B, S, V/tp]."""
        if self._hooked:
            return output[0][inverse]
        return output[rows, cols]

    def _set_positions(self, position_ids: torch.Tensor) -> None:
        """The position ids [mb, S] of the chunk call about to run, for the per-row RoPE of a packed forward."""
        if self.tree is not None and self.tree.active:
            self.tree.positions = position_ids

    @contextmanager
    def _output_layer_on_scored_positions(self):
        """While inside: every output_layer of our chunks computes logits at self._picks only (see the docstring)."""
        layers = [getattr(unwrap(c), "output_layer", None) for c in self.chunks]
        layers = [layer for layer in layers if layer is not None]
        handles = [h for layer in layers for h in (
            layer.register_forward_pre_hook(self._pick_hidden_states, with_kwargs=True),
            layer.register_forward_hook(_restore_sequence_parallel))]
        self._hooked = bool(layers)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for layer in layers:
                _restore_sequence_parallel(layer)
            self._hooked, self._picks, self._inverse = False, None, None

    def _pick_hidden_states(self, layer, args, kwargs):
        """output_layer pre-hook: hidden states [S(/tp), B, H] -> [U, 1, H] at the U distinct scored (row, col)
        positions (self._inverse maps the N picks to them: single-token choices share their context's last one)."""
        hidden, rows, cols = args[0], *self._picks
        if getattr(layer, "sequence_parallel", False):  # [S/tp, B, H] on each TP rank: gather the sequence first
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, group=self.layout.tp_group)
            layer.sequence_parallel, layer._nano_eval_sequence_parallel = False, True  # until this call returns
        if "runtime_gather_output" in kwargs:  # megatron's inference path asks for a full-vocab gather: keep V/tp
            kwargs = {**kwargs, "runtime_gather_output": False}
        flat, self._inverse = torch.unique(cols * hidden.shape[1] + rows, return_inverse=True)
        return (hidden.flatten(0, 1)[flat].unsqueeze(1), *args[1:]), kwargs

    def _padded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, S] -> [B, S'] with S' = self._columns(S)."""
        s = input_ids.shape[1]
        return F.pad(input_ids, (0, self._columns(s) - s), value=self._pad_id)

    def _columns(self, s: int) -> int:
        """The columns a batch of S tokens runs with: pad_to_length, or S rounded up for sequence parallelism."""
        target = self.pad_to_length or math.ceil(s / self.seq_multiple) * self.seq_multiple
        if target < s:
            raise NanoEvalError(f"a batch of {s} tokens is longer than pad_to_length={self.pad_to_length}. "
                                f"Fix: set max_length <= pad_to_length (now {self.max_length}).")
        return target

    @property
    def _pad_id(self) -> int:
        return self.tokenizer.pad_token_id or 0

    @staticmethod
    def _inputs(input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """GPTModel's (input_ids, position_ids, attention_mask): positions 0.. per row, causal mask [1, 1, S, S] True
        above the diagonal (masked), as Megatron's get_ltor_masks_and_position_ids builds them."""
        b, s = input_ids.shape
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        mask = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).triu(1)[None, None]
        return input_ids, position_ids, mask

    # ---- pipeline parallel: Megatron's schedule ------------------------------------------------------------------

    @property
    def decode_microbatches(self) -> int:
        """Microbatches per KV-cache decoding step: 1, or pp under the interleaved schedule (it wants a multiple
        of pp)."""
        return self.layout.pp_size if len(self.chunks) > 1 else 1

    def _forward_pipelined(self, inputs, rows, cols, context=None) -> torch.Tensor | None:
        """Run the batch through Megatron's schedule in microbatches of `micro_batch_size` rows (with a KV-cache
        context: `decode_microbatches` of them, each told its rows in the cache)."""
        input_ids, position_ids, mask = inputs
        b, s = input_ids.shape
        mbs = b // self.decode_microbatches if context is not None else min(self.micro_batch_size or b, b)
        n_micro = math.ceil(b / mbs)
        if len(self.chunks) > 1:  # the interleaved schedule wants a multiple of pp microbatches
            n_micro = math.ceil(n_micro / self.layout.pp_size) * self.layout.pp_size
        extra = n_micro * mbs - b
        input_ids = F.pad(input_ids, (0, 0, 0, extra), value=self._pad_id)
        position_ids = F.pad(position_ids, (0, 0, 0, extra))
        if mask.shape[0] > 1:
            mask = F.pad(mask, (0, 0, 0, 0, 0, 0, 0, extra), value=True)
        picks = [torch.nonzero(rows // mbs == m).squeeze(-1) for m in range(n_micro)]
        micro = [(m, (input_ids[m * mbs:(m + 1) * mbs], position_ids[m * mbs:(m + 1) * mbs],
                      mask if mask.shape[0] == 1 else mask[m * mbs:(m + 1) * mbs]), rows[p] - m * mbs, cols[p])
                 for m, p in enumerate(picks)]

        def forward_step(data_iterator, model):
            m, micro_inputs, r, c = next(data_iterator)
            self._picks, self._inverse = (r, c), None  # read by the output-layer hook, within this call
            self._set_positions(micro_inputs[1])
            if context is not None:
                context.batch_size_offset = m * mbs  # where this microbatch's rows sit in the KV cache
            output = _call(model, micro_inputs, context)  # logits on the last stage's last chunk, else hidden states
            inverse = self._inverse

            def scored_logits(output_tensor, non_loss_data=False):
                return self._at_scored(output_tensor, r, c, inverse)  # [n, V/tp]

            return output, scored_logits

        iterators = [iter(micro) for _ in self.chunks] if len(self.chunks) > 1 else iter(micro)
        # CP is off while scoring, but the schedule sizes its stage-to-stage buffers as seq_length / cp
        collected = call_schedule(forward_step, iterators, self.chunks, num_microbatches=n_micro,
                                  seq_length=s * self.layout.cp_size, micro_batch_size=mbs)
        if context is not None:
            context.batch_size_offset = 0
        if not self.layout.is_output_stage:
            return None
        out = torch.empty(rows.numel(), collected[0].shape[-1], dtype=collected[0].dtype, device=collected[0].device)
        for p, logits in zip(picks, collected, strict=True):
            out[p] = logits
        return out


def _call(chunk, inputs, context):
    """chunk(input_ids, position_ids, attention_mask) [+ the KV-cache context; megatron's inference path asserts
    a full-vocab gather is asked for, which the output-layer hook turns back into vocab-parallel logits]."""
    if context is None:
        return chunk(*inputs)
    return chunk(*inputs, inference_context=context, runtime_gather_output=True)


def _restore_sequence_parallel(layer, *unused) -> None:
    """Undo _pick_hidden_states' switch of the output layer's sequence-parallel gather (a forward hook)."""
    if layer.__dict__.pop("_nano_eval_sequence_parallel", False):
        layer.sequence_parallel = True
