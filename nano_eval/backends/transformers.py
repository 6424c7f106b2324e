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
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from nano_eval.backends.base import Batch
from nano_eval.errors import NanoEvalError
from nano_eval.parallel import ParallelLayout
from nano_eval.decoder import CacheDecoder, positions
from nano_eval.rows import tree_attention_mask


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
        self.cache_writes_rows = _writable(_model_cache(model))  # continuous batching (TransformersCache)

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

    def incremental_decoder(self, shared_prefix_tokens: int = 0) -> CacheDecoder:
        """Greedy generation from a KV cache (nano_eval.decoder): each prompt runs once, then one token per row per
        step, finished rows' slots refilled; prompts starting with the same `shared_prefix_tokens` or more tokens
        run that prefix once (0: never)."""
        return CacheDecoder(lambda: TransformersCache(self), shared_prefix_tokens)

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


class TransformersCache:
    """transformers' own KV cache for one batch of rows (the KVCache of nano_eval.decoder; one process holds the
    whole model, tp = pp = 1). The mask of real columns goes to the model as its 2D attention mask and the positions
    count real tokens only, as transformers' `generate` does. Full-attention models get a DynamicCache of
    _GrowingLayer (room for the batch's columns, written in place); others build their own cache (sliding windows
    and the like). Several new columns may follow earlier ones (a shared prompt prefix) on models whose layers are
    all full causal attention (`backend.shares_prompt_prefix`): a sliding window counts columns, and would count the
    padding between prefix and suffix as tokens.

    Rows are selected, trimmed and written (continuous batching, nano_eval.decoder) in layers that keep a column's
    keys and values as tensors [B, kv_heads, columns, head_dim]: DynamicLayer (and _GrowingLayer) and
    DynamicSlidingWindowLayer, which holds the last window - 1 columns only (a refilled row is left-padded, so its
    window still covers its own tokens). `writes_rows` is False for caches with other layers (states of recurrent
    layers, quantized or indexed caches): their prompts then wait until the pool is empty."""

    def __init__(self, backend: TransformersModel):
        self.backend = backend
        self.multi_token_extend = backend.shares_prompt_prefix
        self.cache = None
        self.rows = self.length = self.limit = 0  # rows, columns so far, room per row
        self.writes_rows = backend.cache_writes_rows
        # transformers renamed `past_key_values` to `cache` (5.x; the old name warns, then goes in 5.40)
        model = backend.model.get_decoder() if backend._head_only_on_scored else backend.model
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def allocate(self, rows: int, columns: int) -> None:
        self.cache = _growing_cache(self.backend.model, columns)
        self.rows, self.length, self.limit = rows, 0, columns

    def select_rows(self, index: torch.Tensor, start: int = 0, columns: int | None = None) -> None:
        if not start and columns is None:
            self.cache.batch_select_indices(index.to(self.backend.device))
        else:
            index = index.to(self.backend.device)
            for layer in _layers(self.cache):
                keep = self.length - start  # columns kept, of which the layer holds the last ones
                layer.keys = _fit(layer.keys.index_select(0, index), _held(layer, keep))
                layer.values = _fit(layer.values.index_select(0, index), _held(layer, keep))
                _set_length(layer, keep, columns)
        self.rows, self.length = len(index), self.length - start
        self.limit = columns or self.limit

    def write_rows(self, slots: torch.Tensor, source: TransformersCache | None, rows: torch.Tensor | None = None,
                   columns: int | None = None) -> None:
        if source is None:
            return  # the `real` mask of the next run says the slots hold no tokens
        if self.cache is None:
            self.cache = _model_cache(self.backend.model)
        device = self.backend.device
        slots = slots.to(device)
        rows = (torch.arange(len(slots)) if rows is None else rows).to(device)
        n = source.length if columns is None else columns
        length = max(self.length, n)
        for layer, other in zip(self.cache.layers, source.cache.layers):
            if not layer.is_initialized:
                layer.lazy_initialization(other.keys, other.values)
                layer.keys = other.keys.new_zeros((self.rows, *other.keys.shape[1:2], 0, other.keys.shape[-1]))
                layer.values = other.values.new_zeros((self.rows, *other.values.shape[1:2], 0, other.values.shape[-1]))
            held = _held(layer, length)
            if held != layer.keys.shape[-2]:  # grown by padding columns in front
                layer.keys, layer.values = _fit(layer.keys, held), _fit(layer.values, held)
                _set_length(layer, length, None)
            copied = min(n, held, other.keys.shape[-2])
            for mine, theirs in ((layer.keys, other.keys), (layer.values, other.values)):
                mine[slots, :, : held - copied] = 0
                mine[slots, :, held - copied:] = theirs[rows, :, theirs.shape[-2] - copied:]
        self.length = length

    def run(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """ids [b, n] (the last n columns of `real` [b, S]) through the model; logits [b, V] at the last one."""
        backend, device = self.backend, self.backend.device
        inputs = {"input_ids": ids.to(device), "attention_mask": real.long().to(device),
                  "position_ids": positions(real)[:, -ids.shape[1]:].to(device), self._cache_arg: self.cache,
                  "use_cache": True}
        if backend._head_only_on_scored:
            out = backend.model.get_decoder()(**inputs)
            logits = backend.model.get_output_embeddings()(out.last_hidden_state[:, -1])
        else:
            out = backend.model(**inputs)
            logits = out.logits[:, -1]
        self.cache = getattr(out, self._cache_arg)
        self.rows, self.length = ids.shape[0], real.shape[1]
        return logits


def _model_cache(model) -> DynamicCache | None:
    """The DynamicCache the model builds for itself (None for a config DynamicCache cannot take)."""
    try:
        return DynamicCache(config=model.config)
    except Exception:  # noqa: BLE001 -- an unusual config: the model chooses its cache
        return None


def _writable(cache) -> bool:
    """Whether TransformersCache can select, trim and write rows of every layer of `cache`."""
    return isinstance(cache, DynamicCache) and bool(cache.layers) and all(
        type(layer) in (DynamicLayer, _GrowingLayer, DynamicSlidingWindowLayer) for layer in cache.layers)


def _layers(cache) -> list:
    return [layer for layer in cache.layers if layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4]


def _held(layer, length: int) -> int:
    """Columns a layer holds of `length` columns: all, or a sliding window's last window - 1."""
    return min(length, layer.sliding_window - 1) if isinstance(layer, DynamicSlidingWindowLayer) else length


def _fit(t: torch.Tensor, columns: int) -> torch.Tensor:
    """t [B, H, S, D] -> [B, H, columns, D]: its last `columns` columns, zero columns in front where it has fewer."""
    if t.shape[-2] >= columns:
        return t[..., t.shape[-2] - columns:, :]
    return torch.cat([t.new_zeros((*t.shape[:-2], columns - t.shape[-2], t.shape[-1])), t], dim=-2)


def _set_length(layer, length: int, limit: int | None) -> None:
    """After a layer's keys / values were replaced: its column count (sliding layers count every column seen) and,
    for a _GrowingLayer, new room on its next update (`limit`: its room per row)."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        layer.cumulative_length = length
    if isinstance(layer, _GrowingLayer):
        layer.room = None
        layer.limit = limit or layer.limit


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


def _growing_cache(model, limit: int) -> DynamicCache | None:
    """A DynamicCache of _GrowingLayer (room for `limit` columns at most) when the model's own cache would be all
    plain DynamicLayer (full attention in every layer), else None (the model builds its own: sliding-window layers and
    the like, which hold at most `limit` columns as well)."""
    cache = _model_cache(model)
    if cache is None or not cache.layers or any(type(layer) is not DynamicLayer for layer in cache.layers):
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
