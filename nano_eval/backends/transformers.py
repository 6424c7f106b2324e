"""Transformers backend: the reference every other backend is checked against.

One process, or data-parallel under torchrun (each rank holds the whole model). Only the scored positions go
through the output projection: the decoder runs once, then `lm_head` sees N hidden states instead of B x S.

Models with any attention layer that is not full causal attention (sliding windows: Mistral, Gemma-2/3, Qwen2 with
use_sliding_window; chunked attention) get neither packed rows nor a shared generation prefix: transformers applies
a window by column, which is only right when a row's real tokens sit in consecutive columns (plain right-padded
scoring rows, left-padded generation rows), and a custom 4D mask (packed rows) replaces its window masks.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from nano_eval.backends.base import Batch
from nano_eval.errors import NanoEvalError
from nano_eval.parallel import ParallelLayout
from nano_eval.rows import common_prefix_length, left_padded, tree_attention_mask


class TransformersModel:
    """A causal LM from transformers behind the backend protocol (see nano_eval.backends.base.Backend).

    Takes packed rows (nano_eval.rows) when its attention takes a custom 4D mask (sdpa: bool, eager: additive) and
    every layer is full causal attention. Load a saved model folder or Hub id with
    nano_eval.checkpoints.hf.load_transformers.
    """

    supports_packed_rows = True
    shares_prompt_prefix = True  # incremental_decoder(shared_prefix_tokens=n) prefills a common prefix once

    def __init__(self, model, tokenizer, *, layout: ParallelLayout | None = None, max_length: int | None = None):
        self.model = self.module = model
        self.tokenizer = tokenizer
        self.layout = layout or ParallelLayout.data_parallel()
        self.max_length = max_length or _model_max_length(model, tokenizer)
        self.vocab_size = getattr(model.get_input_embeddings(), "num_embeddings", None)
        self.device = next(model.parameters()).device
        self._head_only_on_scored = _can_split_head(model)
        self._attn = getattr(model.config, "_attn_implementation", None)
        self.attention_kinds = attention_kinds(model.config)
        full_causal = self.attention_kinds <= {"full_attention"}
        self.supports_packed_rows = self._attn in ("sdpa", "eager") and full_causal
        self.shares_prompt_prefix = full_causal

    @torch.no_grad()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [N, V] at the scored positions (tp = pp = 1, so every rank is an output stage)."""
        inputs = {"input_ids": batch.input_ids.to(self.device), "attention_mask": batch.attention_mask.to(self.device)}
        if batch.position_ids is not None:
            inputs["position_ids"] = batch.position_ids.to(self.device)
            inputs["attention_mask"] = self._tree_mask(batch)
        rows, cols = batch.rows.to(self.device), batch.cols.to(self.device)
        if not self._head_only_on_scored:
            return self.model(**inputs, use_cache=False).logits[rows, cols]
        hidden = self.model.get_decoder()(**inputs, use_cache=False).last_hidden_state
        # Choices of one document are scored at the same position (the context's last token): project it once.
        flat, inverse = torch.unique(rows * hidden.shape[1] + cols, return_inverse=True)
        scored = hidden.flatten(0, 1)[flat]
        return self.model.get_output_embeddings()(scored)[inverse]

    def incremental_decoder(self, shared_prefix_tokens: int = 0) -> "CachedDecoder":
        """Greedy generation from a KV cache: each batch's prompts run once, then one token per row per step;
        prompts starting with the same `shared_prefix_tokens` or more tokens run that prefix once (0: never)."""
        return CachedDecoder(self, shared_prefix_tokens)

    def _tree_mask(self, batch: Batch) -> torch.Tensor:
        """4D mask from the batch's segment/branch ids: bool for sdpa (True = attend), additive for eager."""
        if not self.supports_packed_rows:
            raise NanoEvalError(f"this model cannot take packed rows (attention implementation {self._attn!r}, layer "
                                f"kinds {sorted(self.attention_kinds)}). Fix: BatchingConfig(packing=False), or sdpa / "
                                "eager attention on a model whose layers are all full causal attention.")
        mask = tree_attention_mask(batch.segment_ids.to(self.device), batch.branch_ids.to(self.device))
        if self._attn == "sdpa":
            return mask
        dtype = next(self.model.parameters()).dtype
        return torch.zeros(mask.shape, dtype=dtype, device=self.device).masked_fill_(~mask, torch.finfo(dtype).min)


class CachedDecoder:
    """Incremental decoding of one batch of prompts with transformers' own KV cache (see nano_eval.generate).

    Prompts are left-padded, so every row's newest token sits in the last column, and position ids count each
    row's real tokens only (as transformers' `generate` does): each row sees what it would see alone. Rows that
    finish are dropped from the cache, so they stop costing compute. One process holds the whole model (tp = pp = 1).

    Prompts that start with the same `shared_prefix_tokens` (> 0) or more tokens (fixed few-shot examples) share them:
    the common prefix runs once as a batch of one, its cache is copied to every row, and only each prompt's own
    suffix is prefilled. Columns are then [prefix | left padding | suffix]: the padding sits between the two and is
    masked out, and positions still count real tokens only, so each row again sees exactly its own prompt. Only on
    models whose layers are all full causal attention (`backend.shares_prompt_prefix`): a sliding window counts
    columns, and would count the padding between prefix and suffix as tokens.

    Memory: the cache holds at most rows x (longest prompt + max_new_tokens) columns per layer (the shared prefix is
    copied into every row), the budget the engine's generation batches are cut by (nano_eval.data).
    """

    def __init__(self, backend: TransformersModel, shared_prefix_tokens: int = 0):
        self.backend = backend
        self.shared_prefix_tokens = shared_prefix_tokens if backend.shares_prompt_prefix else 0  # 0: never share
        self.cache = None
        # transformers renamed `past_key_values` to `cache` (5.x; the old name warns, then goes in 5.40)
        model = backend.model.get_decoder() if backend._head_only_on_scored else backend.model
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.mask: torch.Tensor | None = None  # [b, S] 1 on real tokens (prompt and generated), 0 on padding
        self.shared = 0  # length of the prefix the last prefill shared (0: none)

    def prefill(self, prompts: list[list[int]], pad_id: int, max_new_tokens: int,
                width: int | None = None) -> torch.Tensor:
        """Logits [B, V] at each prompt's last token; fills the cache with the prompts (room for the longest prompt,
        or `width` columns of left-padded prompts, + max_new_tokens columns at most; no shared prefix then)."""
        limit = max(max(map(len, prompts)), width or 0) + max_new_tokens
        self.cache = _growing_cache(self.backend.model, limit)
        self.shared = 0 if width else self._shared_length(prompts)
        if self.shared:
            self.mask = torch.ones((1, self.shared), dtype=torch.int64)
            self._forward(torch.tensor([prompts[0][: self.shared]], dtype=torch.int64))
            self.cache.batch_repeat_interleave(len(prompts))
        ids, mask = left_padded([p[self.shared :] for p in prompts], pad_id, width)
        self.mask = torch.cat([torch.ones((len(prompts), self.shared), dtype=torch.int64), mask.long()], dim=1)
        return self._forward(ids)

    def _shared_length(self, prompts: list[list[int]]) -> int:
        """Tokens every prompt starts with, leaving each at least one of its own; 0 when under the threshold."""
        if len(prompts) < 2 or not self.shared_prefix_tokens:
            return 0
        first, n = prompts[0], min(len(p) for p in prompts) - 1
        for p in prompts[1:]:
            n = common_prefix_length(first, p, n)
        return n if n >= self.shared_prefix_tokens else 0

    def extend(self, keep: list[int], next_ids: list[int]) -> torch.Tensor:
        """Keep rows `keep` (indices into the current rows, in order), append `next_ids[k]` to row keep[k];
        logits [len(keep), V] at the appended tokens."""
        if len(keep) < self.mask.shape[0]:
            index = torch.tensor(keep, dtype=torch.int64)
            self.cache.batch_select_indices(index.to(self.backend.device))
            self.mask = self.mask[index]
        self.mask = torch.cat([self.mask, torch.ones((len(keep), 1), dtype=torch.int64)], dim=1)
        return self._forward(torch.tensor(next_ids, dtype=torch.int64)[:, None])

    def _forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        """Run `new_ids` [b, n] (the last n columns of self.mask) through the model; logits [b, V] at the last one."""
        backend, device = self.backend, self.backend.device
        positions = (self.mask.cumsum(dim=1) - 1).clamp(min=0)[:, -new_ids.shape[1]:]
        inputs = {"input_ids": new_ids.to(device), "attention_mask": self.mask.to(device),
                  "position_ids": positions.to(device), self._cache_arg: self.cache, "use_cache": True}
        if backend._head_only_on_scored:
            out = backend.model.get_decoder()(**inputs)
            logits = backend.model.get_output_embeddings()(out.last_hidden_state[:, -1])
        else:
            out = backend.model(**inputs)
            logits = out.logits[:, -1]
        self.cache = getattr(out, self._cache_arg)
        return logits


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer that writes new keys/values into spare room at the end of its buffers (grown by a quarter,
    at least 128 tokens, when full, never past `limit` columns unless a write needs them) instead of concatenating:
    a decode step copies one token per row, not the whole cache (DynamicLayer's torch.cat copies B x S x kv-width per
    layer per step, which dominates decoding long few-shot prompts).
    `keys` / `values` stay views [B, kv_heads, S, head_dim] of the filled part, so the rest of DynamicLayer holds."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.room = limit, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.room = None
        n, k = self.get_seq_length(), key_states.shape[-2]
        if self.room is None or n + k > self.room[0].shape[-2]:
            columns = max(n + k, min(self.limit, n + k + max(128, (n + k) // 4)))
            shape = (*key_states.shape[:-2], columns, key_states.shape[-1])
            self.room = (key_states.new_empty(shape), value_states.new_empty(shape))
            if n:
                self.room[0][..., :n, :] = self.keys
                self.room[1][..., :n, :] = self.values
        self.room[0][..., n : n + k, :] = key_states
        self.room[1][..., n : n + k, :] = value_states
        self.keys, self.values = self.room[0][..., : n + k, :], self.room[1][..., : n + k, :]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.room = None  # keys/values are fresh tensors now; the next update moves them into new room

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.room = None


def _growing_cache(model, limit: int) -> DynamicCache | None:
    """A DynamicCache of _GrowingLayer (room for `limit` columns at most) when the model's own cache would be all
    plain DynamicLayer (full attention in every layer), else None (the model builds its own: sliding-window layers and
    the like, which hold at most `limit` columns as well)."""
    try:
        cache = DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 -- an unusual config: let the model choose its cache
        return None
    if not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
        return None
    cache.layers = [_GrowingLayer(limit) for _ in cache.layers]
    return cache


def attention_kinds(config) -> set[str]:
    """The kinds of attention the model's layers use ("full_attention", "sliding_attention", "chunked_attention",
    ...), from `layer_types` or, in configs without it, from `sliding_window` / `attention_chunk_size` (as
    transformers' DynamicCache reads them); layers without attention are left out."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = getattr(config, "layer_types", None)
    if not kinds:
        if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
            kinds = ["sliding_attention"]
        elif getattr(config, "attention_chunk_size", None) is not None:
            kinds = ["chunked_attention"]
        else:
            kinds = ["full_attention"]
    return set(kinds) - {"moe", "mlp", "dummy"}


def _model_max_length(model, tokenizer) -> int:
    for attr in ("max_position_embeddings", "n_positions", "seq_length"):
        value = getattr(model.config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    if 0 < getattr(tokenizer, "model_max_length", 0) < 1_000_000:
        return tokenizer.model_max_length
    return 2048


def _can_split_head(model) -> bool:
    """Running lm_head on scored positions only is exact when the logits are a plain projection of the decoder's
    last hidden state (no soft-capping or scaling after it)."""
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return False
    try:
        return model.get_decoder() is not None and model.get_output_embeddings() is not None
    except (AttributeError, NotImplementedError):
        return False
