"""Packed rows on megatron-core: a document's context once, its continuations beside it, under a tree mask.

nano_eval.packing builds rows that hold a document's context once and each continuation after it (and several
documents, or a few-shot prefix shared by documents); nano_eval.rows describes the mask that makes every scored
logit the one a row of its own would give: token i sees token j iff j <= i on i's path (its document's context,
its own continuation, the row's shared prefix), and position ids restart each continuation after the context.

megatron-core's GPTModel takes most of that as it is: its local core attention (`DotProductAttention`) applies any
`attention_mask [B, 1, S, S]` (True = masked) it is given, and learned absolute positions come from `position_ids`.
Two things are ours, switched on for one forward by `TreeForward.applied()` and put back after:
- RoPE ignores `position_ids`: the model builds one table `[S, 1, 1, dim]` for columns 0..S-1. A forward hook on
  each rotary module hands the attention layers `[S, B, 1, dim]` instead: column c of row b at its position
  `positions[b, c]` (the microbatch in flight; `TreeForward.positions` is set before each chunk's call). Fused RoPE
  (`apply_rope_fusion`, GPU) takes one position table for all rows, so it is off for that forward.
- `FusedScaleMaskSoftmax` layers declared causal are told they hold a padding mask: with fp16/bf16 and
  `masked_softmax_fusion=True` (Megatron-LM's default) a causal layer takes the fused upper-triangular kernel for
  square score blocks, and that kernel applies no mask. With the padding type the mask given is applied (the fused
  masked kernel where its shape rules allow, else torch's softmax).
- The local core attention itself runs as one fused kernel: `DotProductAttention` materialises the scores
  `[B x heads, S, S]` and a masked softmax over them (eager), 1.3-1.7x the transformers path's time on 5-shot rows of
  a thousand columns. While packed, each such module's forward is `tree_attention` instead: torch's
  scaled_dot_product_attention over the same q, k, v with the tree as a boolean mask, the module's own softmax scale
  (its query-key layer scaling included), GQA groups repeated as megatron repeats them. Same softmax(QK^T)V (the
  tree mask leaves no query row fully masked: padding sees earlier padding, so no softmax row is empty). Modules
  with a softmax offset (0.19's `softmax_type` other than vanilla) or attention dropout in training mode keep
  megatron's.
Sequence parallelism needs nothing: the attention sees the whole sequence after the gather, and the table covers
every column (megatron sizes it for S x tp).

Not for (`packed_rows_problem` says why; the backend then gets plain right-padded rows, exact under causal
attention): Transformer Engine / flash attention cores (megatron passes them a mask type, not our mask, for causal
layers), sliding-window attention (the softmax builds its own window mask), multi-latent attention, position
embeddings other than rope / learned absolute / none, multimodal RoPE.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
import torch.nn.functional as F

from nano_eval.backends.base import Batch
from nano_eval.compat.megatron import unwrap
from nano_eval.rows import PAD, tree_attention_mask

_POSITIONS = ("rope", "learned_absolute", "none")


def packed_rows_problem(chunks) -> str | None:
    """Why these model chunks (this pipeline stage's) cannot score packed rows exactly; None when they can."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for model in map(unwrap, chunks):
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "decoder"):
            return "not a megatron-core GPTModel"
        kind = getattr(model, "position_embedding_type", None)
        if kind not in _POSITIONS:
            return f"position embedding {kind!r}"
        for flag in ("multi_latent_attention", "window_size"):
            if getattr(config, flag, None):
                return f"config.{flag}"
        for layer in model.decoder.layers:
            core = getattr(getattr(layer, "self_attention", None), "core_attention", None)
            if not isinstance(core, DotProductAttention):
                return f"core attention {type(core).__name__} (a tree mask needs megatron's DotProductAttention)"
    return None


def tree_inputs(batch: Batch, columns: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTModel's (input_ids [B, C], position_ids [B, C], attention_mask [B, 1, C, C] bool, True = masked) of a
    packed batch, right-padded from S to `columns` >= S columns (sequence parallelism, pad_to_length)."""
    grow = (0, columns - batch.input_ids.shape[1])
    segments = F.pad(batch.segment_ids, grow, value=PAD)
    mask = ~tree_attention_mask(segments, F.pad(batch.branch_ids, grow))
    return F.pad(batch.input_ids, grow, value=pad_id), F.pad(batch.position_ids, grow), mask


class TreeForward:
    """What one packed forward switches in `chunks` (see the module docstring). Set `positions` [mb, S] (the
    microbatch about to run) before each chunk's call, inside `applied()`."""

    def __init__(self, chunks):
        self.models = [unwrap(c) for c in chunks]
        self.positions: torch.Tensor | None = None
        self.active = False  # inside applied()

    @contextmanager
    def applied(self):
        from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        flips, fused = [], []
        for model in self.models:
            modules = list(model.modules())
            fused += [m for m in modules if type(m) is DotProductAttention and _fusable(m)]
            flips += [(m, "attn_mask_type", AttnMaskType.padding) for m in modules
                      if isinstance(m, FusedScaleMaskSoftmax) and m.attn_mask_type == AttnMaskType.causal]
            configs = {id(c): c for c in (getattr(m, "config", None) for m in modules) if c is not None}
            flips += [(c, "apply_rope_fusion", False) for c in configs.values()
                      if getattr(c, "apply_rope_fusion", None) is True]
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in flips]
        with ExitStack() as stack:
            for module in fused:  # an instance attribute over the class's forward, deleted after
                module.forward = tree_attention.__get__(module)
                stack.callback(module.__dict__.pop, "forward", None)
            for model in self.models:
                rotary = getattr(model, "rotary_pos_emb", None)
                if model.position_embedding_type == "rope" and rotary is not None:
                    stack.callback(rotary.register_forward_hook(self._per_row_rotary).remove)
            try:
                for obj, attr, value in flips:
                    setattr(obj, attr, value)
                self.active = True
                yield self
            finally:
                for obj, attr, value in reversed(saved):
                    setattr(obj, attr, value)
                self.positions, self.active = None, False

    def _per_row_rotary(self, module, args, emb: torch.Tensor) -> torch.Tensor:
        """RoPE table [S, 1, 1, dim] -> [S, mb, 1, dim]: column c of row b at position positions[b, c]."""
        positions = self.positions.to(emb.device)
        return emb[:, 0][positions.t()]


def _fusable(core) -> bool:
    """Whether tree_attention computes this local DotProductAttention's forward exactly."""
    if getattr(core, "softmax_offset", None) is not None:  # 0.19's off-by-one / learnable softmax
        return False
    return not (core.training and core.attention_dropout.p > 0)


def tree_attention(core, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                   attn_mask_type=None, attention_bias=None, packed_seq_params=None) -> torch.Tensor:
    """DotProductAttention.forward of `core` as one scaled_dot_product_attention: query [sq, b, np, hn], key /
    value [sk, b, ng, hn] (this rank's heads), attention_mask [b, 1, sq, sk] bool (True = masked; tree_inputs' mask,
    in which no query row is fully masked) -> context [sq, b, np x hn]."""
    if attention_bias is not None or packed_seq_params is not None:
        raise RuntimeError("nano_eval's packed megatron attention got an attention bias or packed sequence params")
    sq, b, heads, _ = query.shape
    group = heads // key.shape[2]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    layer_scale = core.scale_mask_softmax.scale
    scale = core.softmax_scale * (1.0 if layer_scale is None else layer_scale)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask, scale=scale)  # [b, heads, sq, hn]
    return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
