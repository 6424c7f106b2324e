"""Packed rows on nanotron: a document's context once, its continuations beside it, under a tree mask; and the output
layer on the scored positions only.

nano_eval.packing builds rows that hold a document's context once and each continuation after it (and several
documents, or a few-shot prefix shared by documents); nano_eval.rows describes the tree mask and the position ids
that make every scored logit the one a row of its own gives. nanotron's attention takes neither: nanotron 0.4's
Llama runs flash-attn's varlen kernel over one causal span per row (from the mask's lengths) and rotates q / k at
columns 0..S-1; nanotron main's Qwen2 starts a document wherever a position id is 0 but still rotates at columns.
So while a packed batch runs, `TreeAttention.applied()` gives each attention layer of the model (the model's own
modules: qkv / o projections, norms, MLP or MoE, TP collectives, the pipeline's P2P, all untouched) two things of
ours, and takes them back after the forward:
- RoPE at each token's own position: the layer's own rotary module (flash-attn's RotaryEmbedding, as the training
  path uses it) with every token as a sequence of one at `seqlen_offset = position` (what nano_eval's Qwen2 KV
  cache does): the same cos / sin values and kernel as the unpacked row, only the offsets differ;
- attention under the tree mask `[B, 1, S, S]`: torch's scaled_dot_product_attention in fp32 (flash-attn
  accumulates in fp32 too; the output is cast back to the model's dtype), grouped-query heads repeated to the query
  heads, the layer's softmax scale (nanotron main's µP scale included), and for Qwen2 its sliding window counted in
  positions (a token sees the w - 1 before it on its own path; none in no-RoPE layers, as the model does).
Llama (0.4 and main): the instance's `flash_rotary_embedding.forward` and `attention.forward` (CoreAttention) are
replaced; Qwen2 (main): the instance's `_forward_packed`. Position ids reach every pipeline stage from the batch
(every rank of a replica holds it), so nothing new travels between stages. Under `tp_mode: REDUCE_SCATTER` the
attention sees the whole sequence (the qkv projection gathers it), so the same code serves.

`ScoredHead` is the output layer on the scored positions only, for plain and packed batches alike: a forward
pre-hook on lm_head (a TensorParallelColumnLinear, on the last stage) hands it the distinct scored positions'
hidden states `[U, 1, H]` (Llama) / `[U, H]` (Qwen2) instead of every position's; under REDUCE_SCATTER the
sequence is gathered first and each TP rank hands over its share of the U rows (lm_head gathers them back).
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nano_eval.compat.nanotron import QWEN2
from nano_eval.rows import PAD, tree_attention_mask


_NOTHING = object()


def tree_of(batch, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [B, 1, C, C] bool True = attend, positions [B, C] int64) of a packed batch right-padded to `columns`."""
    grow = (0, columns - batch.input_ids.shape[1])
    mask = tree_attention_mask(F.pad(batch.segment_ids, grow, value=PAD), F.pad(batch.branch_ids, grow))
    return mask, F.pad(batch.position_ids, grow)


class TreeAttention:
    """The model's attention layers, switched to the tree mask and per-token RoPE positions inside `applied()` (see
    the module docstring). Found once; every rank of the replica calls `applied` for the same batch."""

    def __init__(self, model, family: str):
        from nanotron.models.llama import CausalSelfAttention

        self.family = family
        if family == QWEN2:
            from nanotron.models.qwen import Qwen2Attention

            self.layers = [m for m in model.modules() if isinstance(m, Qwen2Attention)]
        else:
            self.layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
        self.mask: torch.Tensor | None = None  # [B, 1, S, S] bool, True = attend
        self.positions: torch.Tensor | None = None  # [B, S] int64
        self.offsets: torch.Tensor | None = None  # [B * S] int32: the positions as flash-attn's rotary takes them

    @contextmanager
    def applied(self, mask: torch.Tensor, positions: torch.Tensor):
        """While inside, every attention layer of the model runs `mask` [B, 1, S, S] with RoPE at `positions`."""
        self.mask, self.positions = mask, positions
        self.offsets, self.max_seqlen = positions.reshape(-1).to(torch.int32), int(positions.max()) + 1
        patched = []  # (module, name, ours) of instance attributes set here
        saved = []  # (module, name, what the instance held before: a framework's own wrapper, or nothing)
        try:
            for layer in self.layers:
                if self.family == QWEN2:
                    patched.append((layer, "_forward_packed", self._qwen2_attention(layer)))
                else:
                    patched.append((layer.flash_rotary_embedding, "forward",
                                    self._rotary(layer.flash_rotary_embedding)))
                    patched.append((layer.attention, "forward", self._llama_core(layer)))
            for module, name, fn in patched:
                saved.append((module, name, module.__dict__.get(name, _NOTHING)))
                setattr(module, name, fn)
            yield
        finally:
            for module, name, before in reversed(saved):
                if before is _NOTHING:
                    module.__dict__.pop(name, None)
                else:
                    module.__dict__[name] = before
            self.mask = self.positions = self.offsets = None

    def _rotary(self, rotary):
        """flash-attn RotaryEmbedding.forward(q [b, s, h, d], kv [b, s, 2, g, d]) at self.positions."""
        original = type(rotary).forward

        def forward(qkv, kv=None, seqlen_offset=0, max_seqlen=None, **unused):
            b, s = qkv.shape[:2]
            q, kv = self._rotate(original, rotary, qkv.reshape(b * s, 1, *qkv.shape[2:]),
                                 kv.reshape(b * s, 1, *kv.shape[2:]))
            return q.view(b, s, *q.shape[2:]), kv.view(b, s, *kv.shape[2:])

        return forward

    def _rotate(self, original, rotary, q, kv):
        """q [n, 1, h, d] and kv [n, 1, 2, g, d] (every token a sequence of one), rotated in place at their
        positions by the rotary module's own forward."""
        return original(rotary, q, kv, seqlen_offset=self.offsets.to(q.device), max_seqlen=self.max_seqlen)

    def _llama_core(self, attn):
        """CoreAttention.forward(q [b*s, h, d], k, v [b*s, g, d], masks) -> [b*s, h, d] under the tree mask."""
        scale = 1 / attn.d_qk if getattr(attn.attention, "is_using_mup", False) else None

        def forward(query_states, key_states, value_states, q_sequence_mask, kv_sequence_mask, **unused):
            b, s = self.mask.shape[0], self.mask.shape[-1]
            out = attend(query_states.view(b, s, -1, attn.d_qk), key_states.view(b, s, -1, attn.d_qk),
                         value_states.view(b, s, -1, attn.d_v), self.mask, scale)
            return out.reshape(b * s, -1, attn.d_v)

        return forward

    def _qwen2_attention(self, attn):
        """Qwen2Attention._forward_packed(qkv [b*s, (h + 2g) d], ...) -> [b*s, h*d] under the tree mask (and the
        layer's sliding window, in positions)."""
        config = attn.config
        no_rope = config.no_rope_layer is not None and (attn.layer_idx + 1) % config.no_rope_layer == 0
        heads, groups, d = attn.local_num_heads, attn.local_num_kv_heads, attn.head_dim
        rotary_forward = type(attn.rotary_emb).forward

        def forward(qkv, seq_length, position_ids, cu_seqlens):
            b, s = self.mask.shape[0], self.mask.shape[-1]
            q = qkv[..., :heads * d].view(b * s, 1, heads, d)
            kv = qkv[..., heads * d:].view(b * s, 1, 2, groups, d)
            if not no_rope:
                q, kv = self._rotate(rotary_forward, attn.rotary_emb, q, kv)
            mask, window = self.mask, config.sliding_window_size
            if window is not None and not no_rope:
                distance = self.positions[:, :, None] - self.positions[:, None, :]  # [b, s, s]
                mask = mask & (distance < window).to(mask.device)[:, None]
            out = attend(q.view(b, s, heads, d), kv[:, 0, 0].view(b, s, groups, d), kv[:, 0, 1].view(b, s, groups, d),
                         mask, None)
            return out.reshape(b * s, heads * d)

        return forward


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None) -> torch.Tensor:
    """q [b, s, h, d], k / v [b, s, g, d] (query head i reads kv head i // (h / g), as flash-attn's GQA), mask
    [b, 1, s, s] bool True = attend -> [b, s, h, d] in q's dtype; computed in fp32."""
    group = q.shape[2] // k.shape[2]

    def heads_first(t, repeat=1):
        return t.transpose(1, 2).float().repeat_interleave(repeat, dim=1)

    out = F.scaled_dot_product_attention(heads_first(q), heads_first(k, group), heads_first(v, group),
                                         attn_mask=mask.to(q.device), scale=scale)
    return out.transpose(1, 2).to(q.dtype)


class ScoredHead:
    """lm_head on the distinct scored positions only (see the module docstring), on the stage that holds it."""

    def __init__(self, model, family: str, tp_group, sequence_parallel: bool):
        block = model.lm_head
        self.layer = getattr(block, "pp_block", None)  # None off the last pipeline stage
        self.family, self.tp_group, self.sequence_parallel = family, tp_group, sequence_parallel
        self.picks: tuple[torch.Tensor, torch.Tensor, int] | None = None  # rows, cols, batch rows
        self.inverse: torch.Tensor | None = None
        self.count = 0  # distinct positions projected in the last call

    @contextmanager
    def applied(self, rows: torch.Tensor, cols: torch.Tensor, batch_rows: int):
        if self.layer is None:
            yield self
            return
        self.picks, self.inverse = (rows, cols, batch_rows), None
        handle = self.layer.register_forward_pre_hook(self._pick, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()
            self.picks = None

    def _pick(self, module, args, kwargs):
        """lm_head's input `x` (the PipelineBlock passes it by name) -> the hidden states of the distinct scored
        positions (its share of them under REDUCE_SCATTER)."""
        x = kwargs["x"] if "x" in kwargs else args[0]
        rows, cols, b = self.picks
        tp = dist.get_world_size(self.tp_group) if self.sequence_parallel else 1
        if tp > 1:  # [S/tp, B, H] or [B*S/tp, H]: gather the whole sequence first
            whole = x.new_empty((x.shape[0] * tp, *x.shape[1:]))
            dist.all_gather_into_tensor(whole, x.contiguous(), group=self.tp_group)
            x = whole
        if self.family == QWEN2:  # [B * S, H]
            index, flat = rows * (x.shape[0] // b) + cols, x
        else:  # [S, B, H]
            index, flat = cols * b + rows, x.flatten(0, 1)
        unique, self.inverse = torch.unique(index.to(x.device), return_inverse=True)
        picked = flat[unique]
        self.count = len(unique)
        if tp > 1:  # each rank hands its share; lm_head's all-gather puts them back in order
            share = math.ceil(len(unique) / tp)
            picked = F.pad(picked, (0, 0, 0, share * tp - len(unique)))
            picked = picked[share * dist.get_rank(self.tp_group):share * (dist.get_rank(self.tp_group) + 1)]
        picked = picked if self.family == QWEN2 else picked.unsqueeze(1)
        return ((), {**kwargs, "x": picked}) if "x" in kwargs else ((picked, *args[1:]), kwargs)

    def scored(self, logits: torch.Tensor) -> torch.Tensor:
        """lm_head's (cast) output [U', 1, V/tp] or [U', V/tp] -> logits [N, V/tp] at the picks, in their order."""
        logits = logits if self.family == QWEN2 else logits[:, 0]
        return logits[:self.count][self.inverse]
