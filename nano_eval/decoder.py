"""KV-cache decoding of one batch of prompts: the row bookkeeping every framework shares.

nano_eval.generate.greedy_decode drives the steps (argmax, stop sequences, lockstep, the per-step agreement); a
backend's `incremental_decoder()` hands it a `CacheDecoder`, which keeps the rows' layout (left padding, the
shared prefix, which columns are tokens), sizes the cache and drops finished rows. The framework part is a
`KVCache` that only allocates, selects rows and runs new columns through the model:

- transformers: nano_eval.backends.transformers.TransformersCache (its DynamicCache, grown in place);
- nanotron 0.4's Llama: nano_eval.backends.nanotron_cache.StoreCache (nanotron's own inference Store);
- megatron-core: nano_eval.backends.megatron_cache.StaticCache (megatron-core's StaticInferenceContext);
- nanotron main's Qwen2 (no inference path upstream): nano_eval.backends.nanotron_qwen2_cache.Qwen2Cache.

Rows are left-padded, so every row's newest token sits in the last column; `real` [b, S] says which columns hold
tokens. A row's positions count its real tokens only (as transformers' `generate` does), so each row sees exactly
what it would see alone. With a shared prefix the columns are [prefix | left padding | suffix].
"""

from __future__ import annotations

from typing import Protocol

import torch

from nano_eval.rows import common_prefix_length, left_padded


class KVCache(Protocol):
    """A framework's KV cache for one batch of rows. Every rank of the model replica calls it with the same
    arguments; tensors passed in are on the CPU."""

    multi_token_extend: bool  # can run several new columns onto a non-empty cache (needed to share a prompt prefix)

    def allocate(self, rows: int, columns: int) -> None:
        """A fresh, empty cache for `rows` rows of at most `columns` columns."""
        ...

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` [b'] int64 of the current rows, in that order (an index may repeat: copies)."""
        ...

    def run(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
        """Write ids [b, n] int64 (the n newest columns) into the cache; real [b, S] bool covers every column so far,
        the n new ones included (True = a token, False = padding). Logits [b, V/tp] at the last new column on the
        output pipeline stage, None on the other stages."""
        ...


def positions(real: torch.Tensor) -> torch.Tensor:
    """real [b, S] bool -> [b, S] int64: each column's position among its row's tokens (padding: 0)."""
    return (real.long().cumsum(dim=1) - 1).clamp(min=0)


class CacheDecoder:
    """Decoding state of one batch of prompts on any `KVCache`: what a backend's `incremental_decoder()` returns
    to nano_eval.generate.greedy_decode, which calls `prefill` once and then `extend` once per step, with the same
    arguments on every rank of the model replica.

    Prompts that start with the same `shared_prefix_tokens` (> 0) or more tokens (fixed few-shot examples) share
    them when the cache can extend by several columns: the prefix runs once as a batch of one, its cache is copied to
    every row, and only each prompt's own suffix is prefilled (never under lockstep's agreed width: every DP rank's
    forwards must have the same shapes).

    Memory: the cache holds rows x (longest prompt, or the agreed width, + max_new_tokens) columns, the budget the
    engine's generation batches are cut by (nano_eval.data, nano_eval.lockstep).
    """

    def __init__(self, cache: KVCache, shared_prefix_tokens: int = 0):
        self.cache = cache
        self.shared_prefix_tokens = shared_prefix_tokens if cache.multi_token_extend else 0  # 0: never share
        self.real = torch.zeros((0, 0), dtype=torch.bool)  # [b, S]: which columns so far are tokens
        self.columns = 0  # the cache's capacity per row
        self.shared = 0  # length of the prefix the last prefill shared (0: none)

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], pad_id: int, max_new_tokens: int,
                width: int | None = None) -> torch.Tensor | None:
        """Logits [B, V/tp] at each prompt's last token (output stage; None elsewhere). Prompts are left-padded to
        the longest (or to `width`, lockstep's agreed width, when wider)."""
        self.columns = max(max(map(len, prompts)), width or 0) + max(1, max_new_tokens)
        self.cache.allocate(len(prompts), self.columns)
        self.shared = 0 if width else self._shared_length(prompts)
        prefix = torch.ones((len(prompts), self.shared), dtype=torch.bool)
        if self.shared:
            self.real = prefix[:1]
            self._run(torch.tensor([prompts[0][: self.shared]], dtype=torch.int64))
            self.cache.select_rows(torch.zeros(len(prompts), dtype=torch.int64))
        ids, real = left_padded([p[self.shared :] for p in prompts], pad_id, width)
        self.real = torch.cat([prefix, real], dim=1)
        return self._run(ids)

    @torch.no_grad()
    def extend(self, keep: list[int], next_ids: list[int]) -> torch.Tensor | None:
        """Keep rows `keep` (indices into the current rows, in order), append next_ids[k] to row keep[k]; logits
        [len(keep), V/tp] at the appended tokens (output stage; None elsewhere)."""
        if len(keep) < self.real.shape[0]:
            index = torch.tensor(keep, dtype=torch.int64)
            self.cache.select_rows(index)
            self.real = self.real[index]
        self.real = torch.cat([self.real, torch.ones((len(keep), 1), dtype=torch.bool)], dim=1)
        return self._run(torch.tensor(next_ids, dtype=torch.int64)[:, None])

    def _run(self, ids: torch.Tensor) -> torch.Tensor | None:
        if self.real.shape[1] > self.columns:
            raise RuntimeError(f"KV cache of {self.columns} columns is full: more tokens than the max_new_tokens "
                               "given to prefill")
        return self.cache.run(ids, self.real)

    def _shared_length(self, prompts: list[list[int]]) -> int:
        """Tokens every prompt starts with, leaving each at least one of its own; 0 when under the threshold."""
        if len(prompts) < 2 or not self.shared_prefix_tokens:
            return 0
        first, n = prompts[0], min(len(p) for p in prompts) - 1
        for p in prompts[1:]:
            n = common_prefix_length(first, p, n)
        return n if n >= self.shared_prefix_tokens else 0
