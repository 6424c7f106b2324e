"""A KV cache for torchtitan's decoders (Llama3, Qwen3 dense / MoE, DeepSeek-V3), which have no inference path.

torchtitan's models only have their training forward: `part(tokens, positions=, attention_masks=)` over whole
sequences. `TorchtitanCache` runs that same forward on the NEW columns only and swaps, for the duration of the
call, each layer's inner attention kernel (`attention.inner_attention`: FlexAttention, SDPA or varlen, called with
rotated q, k, v) for `CachedAttention`, which writes the new keys / values into this cache and attends over every
cached column (nano_eval.compat.torchtitan.inner_attention_replaced). Everything else is the model's own modules,
in the model's own layout, exactly as the scoring forward runs them: the token embedding (vocab-parallel under
TP), each block's norms, q / k / v projections (column-parallel: this rank's heads), QK norms, RoPE (torchtitan's
own complex `freqs_cis` / cos-sin cache, indexed by the positions we pass), output projection (row-parallel), MLP
or MoE, the final norm, and the lm_head on the last new column only (vocab-parallel logits [b, V/tp], through the
backend's `_scored`); pipeline stages pass hidden states with the backend's point-to-point sends; FSDP2
parameters are those the backend's `session()` gathered (or gathered per forward under lockstep).

Attention reproduces what the scoring forward gives a row that is its own document: causal over the row's real
tokens, each token at RoPE position = real tokens before it (nano_eval.decoder.positions), padding columns (left
padding; padding after a shared prefix) masked out as keys; a padding query sees itself, so no softmax row is
empty (its output is never used). It runs torch's scaled_dot_product_attention with a boolean mask in float32 with
the layer's own softmax scale (GQA: kv heads repeated to the query heads, query head h on kv head h // group, as
torchtitan's kernels pair them; multi-latent attention: the expanded keys and values its module hands the kernel).
The model sees the new columns of all rows as ONE row of b x n tokens (`[1, b * n]`, each token at its own
position): every module but attention works token by token, and `CachedAttention` takes its rows apart again. So
under sequence parallelism (the sequence split over TP ranks) a decoding step pads b tokens to a multiple of tp,
not every row's one token (as the scoring forward pads its rows); the padding tokens are neither cached nor
attended to (their attention output is zero) and their logits never read.

Memory: rows x columns (the driver's longest prompt + max_new_tokens) x local kv heads x head dim keys and values
per layer of this rank, in the model's compute dtype; attention makes transient float32 copies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nano_eval.compat import torchtitan as tt
from nano_eval.decoder import positions as token_positions


class CachedAttention(torch.nn.Module):
    """Stands in for one layer's inner attention while the cache runs: same call as torchtitan's kernels,
    q [1, W, H, d], k [1, W, H_kv, d], v [1, W, H_kv, d_v] (this rank's heads; DTensors or plain) -> [1, W, H, d_v]."""

    def __init__(self, cache: "TorchtitanCache", layer: str):
        super().__init__()
        self.cache, self.layer = cache, layer

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        if kwargs.get("score_mod") is not None or kwargs.get("out_transform") is not None:
            raise RuntimeError("nano_eval's torchtitan KV cache got an attention with a score_mod / out_transform "
                               "(sinks); nano_eval.compat.torchtitan.cache_unsupported should have refused it")
        out = self.cache.attend(self.layer, tt.local(q), tt.local(k), tt.local(v), scale)
        return tt.like(out, q)


class TorchtitanCache:
    """torchtitan model parts behind the KVCache protocol (nano_eval.decoder): one batch of rows' keys and values
    for this rank's layers (its pipeline stages, its TP share of the heads).

    Every rank of the model replica calls allocate / select_rows / write_rows / run with the same arguments; `run` returns the
    vocab-parallel logits [b, V/tp] of the last new column on the last pipeline stage, None elsewhere."""

    multi_token_extend = True  # any number of new columns onto a non-empty cache (a shared prompt prefix)

    def __init__(self, backend):
        self.backend = backend
        self.keys: dict[str, torch.Tensor] = {}  # layer -> [rows, columns, kv heads/tp, head_dim]
        self.values: dict[str, torch.Tensor] = {}
        self.length = self.columns = 0  # columns written so far; capacity
        self.allocated = 0  # rows of every layer's tensors
        self.rows = self.new = 0  # rows and new columns of the run in flight
        self.mask: torch.Tensor | None = None  # [b, 1, new, length + new] bool: which columns each new one sees

    def allocate(self, rows: int, columns: int) -> None:
        """An empty cache of `rows` rows and up to `columns` columns; each layer's tensors are made by the first
        `run` (or `write_rows`) that reaches it."""
        self.length, self.columns, self.allocated = 0, columns, rows
        self.keys, self.values = {}, {}

    def select_rows(self, index: torch.Tensor, start: int = 0, columns: int | None = None) -> None:
        """Keep rows `index` (in that order, repeats allowed) of every layer's cache, and their columns from `start`
        on, moved to the front; `columns`: the room per row from now on. Keys are cached after RoPE at positions
        counted over real tokens, so moving columns changes no row's positions."""
        capacity = columns or self.columns
        kept = self.length - start
        if kept > capacity:
            raise RuntimeError(f"torchtitan KV cache: {kept} columns kept, room for {capacity}")
        for cache in (self.keys, self.values):
            for layer, tensor in cache.items():
                moved = tensor.new_zeros((len(index), capacity, *tensor.shape[2:]))
                moved[:, :kept] = tensor.index_select(0, index.to(tensor.device))[:, start:self.length]
                cache[layer] = moved
        self.length, self.columns, self.allocated = kept, capacity, len(index)

    def write_rows(self, slots: torch.Tensor, source: "TorchtitanCache | None", rows: torch.Tensor | None = None,
                   columns: int | None = None) -> None:
        """Rows `slots` become `source`'s rows `rows` (default 0..k-1): its last `columns` columns (default: all it
        holds) into this cache's last ones, every row first shifted right by padding columns when this cache holds
        fewer; the slots' columns before them zero. source None: nothing to do (the next run's `real` says the
        slots hold no tokens)."""
        if source is None:
            return
        n = source.length if columns is None else columns
        grow = max(0, n - self.length)
        length = self.length + grow
        if length > self.columns:
            raise RuntimeError(f"torchtitan KV cache of {self.columns} columns holding {self.length}: {n} columns "
                               "written")
        rows = torch.arange(len(slots)) if rows is None else rows
        for mine, theirs in ((self.keys, source.keys), (self.values, source.values)):
            for layer, other in theirs.items():
                tensor = mine.get(layer)
                if tensor is None:
                    tensor = other.new_zeros((self.allocated, self.columns, *other.shape[2:]))
                elif grow:
                    shifted = torch.zeros_like(tensor)
                    shifted[:, grow:length] = tensor[:, :self.length]
                    tensor = shifted
                at = slots.to(tensor.device)
                tensor[at, :length - n] = 0
                tensor[at, length - n:length] = other[rows.to(other.device), source.length - n:source.length]
                mine[layer] = tensor
        self.length = length

    @torch.no_grad()
    def run(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
        """Write the n new columns `ids` [b, n] into the cache; `real` [b, S] marks the tokens of every column so
        far, the new ones included. Logits [b, V/tp] at the last new column on the last stage, None elsewhere."""
        b, n = ids.shape
        total = real.shape[1]
        if total != self.length + n or total > self.columns:
            raise RuntimeError(f"torchtitan KV cache of {self.columns} columns holding {self.length}: {n} new "
                               f"columns, {total} in the mask")
        device = self.backend.device
        real = real.to(device)
        columns = torch.arange(total, device=device)
        queries = columns[-n:, None]
        causal = columns[None, :] <= queries  # [n, S]
        itself = columns[None, :] == queries
        self.mask = ((real[:, None, :] & causal[None]) | itself[None])[:, None]  # [b, 1, n, S]
        self.rows, self.new = b, n
        positions = token_positions(real)[:, -n:]
        last = torch.arange(b, device=device) * n + n - 1  # each row's last new column in the one flat row
        try:
            with tt.inner_attention_replaced([s.module for s in self.backend.stages],
                                             lambda layer: CachedAttention(self, layer)):
                logits = self.backend.run(ids.to(device).reshape(1, b * n), positions.reshape(1, b * n),
                                          torch.zeros_like(last), last, masks=False)
        finally:
            self.mask = None
        self.length, self.allocated = total, b
        return logits

    def attend(self, layer: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None):
        """One layer: local q [1, W, H, d], k / v [1, W, H_kv, d(_v)] of the new columns of every row in one flat
        row (W >= b x n: sequence-parallel padding at the end) -> attention output [1, W, H, d_v]."""
        b, n, start = self.rows, self.new, self.length
        width = q.shape[1]

        def rows(t):  # [1, W, heads, d] -> [b, n, heads, d]
            return t[0, :b * n].view(b, n, *t.shape[2:])

        q, k, v = rows(q), rows(k), rows(v)
        if layer not in self.keys:
            self.keys[layer] = k.new_zeros(b, self.columns, *k.shape[2:])
            self.values[layer] = v.new_zeros(b, self.columns, *v.shape[2:])
        keys, values = self.keys[layer], self.values[layer]
        keys[:, start:start + n] = k
        values[:, start:start + n] = v
        group = q.shape[2] // k.shape[2]

        def heads_first(cache):  # [b, S, H_kv, d] -> [b, H, S, d], float32
            return cache[:, :start + n].transpose(1, 2).float().repeat_interleave(group, dim=1)

        out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), heads_first(keys), heads_first(values),
                                             attn_mask=self.mask, scale=scale)  # [b, H, n, d_v]
        out = out.to(q.dtype).transpose(1, 2).reshape(1, b * n, q.shape[2], -1)
        return F.pad(out, (0, 0, 0, 0, 0, width - b * n)).contiguous()
