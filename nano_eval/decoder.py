"""KV-cache decoding with continuous batching: the row bookkeeping every framework shares.

nano_eval.generate.greedy_decode drives the steps (argmax, stop sequences, which prompt enters which slot, lockstep,
the per-step agreement); a backend's `incremental_decoder()` hands it a `CacheDecoder`, which keeps the rows'
layout (left padding, the shared prefix, which columns are tokens), sizes the cache, drops finished rows and puts
new prompts into freed slots. The framework part is a `KVCache` that only allocates, selects rows (and trims
leading padding columns), writes rows copied from another cache of the same model, and runs new columns through
the model:

- transformers: nano_eval.backends.transformers.TransformersCache (its DynamicCache, grown in place);
- nanotron 0.4's Llama: nano_eval.backends.nanotron_cache.StoreCache (nanotron's own inference Store);
- megatron-core: nano_eval.backends.megatron_cache.StaticCache (megatron-core's StaticInferenceContext);
- nanotron main's Qwen2 (no inference path upstream): nano_eval.backends.nanotron_qwen2_cache.Qwen2Cache.

Rows are left-padded, so every row's newest token sits in the last column; `real` [b, S] says which columns hold
tokens. A row's positions count its real tokens only (as transformers' `generate` does), so each row sees exactly
what it would see alone, wherever its tokens sit. With a shared prefix the columns are [prefix | padding | suffix].

Continuous batching: a prompt that enters a freed slot (a "refill") is prefilled as a batch of its own in a fresh
cache of the same model (the shared prefix copied from the pool's prefix cache, not recomputed), then copied into
the slot right-aligned: its last prompt token in the same column as every other row's newest token, the slot's
columns before it padding. Columns every row holds as padding (the slots of long-finished rows) are dropped when
the cache is full, so a row never needs more than its prompt + max_new_tokens columns (module docstring of
nano_eval.generate: the memory bound).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from nano_eval.rows import common_prefix_length, left_padded


class KVCache(Protocol):
    """A framework's KV cache for one batch of rows. Every rank of the model replica calls it with the same
    arguments; tensors passed in are on the CPU. A cache keeps its columns aligned across rows (row r's column c is
    every other row's column c) except where it says otherwise (nanotron's Store keeps each row from its first
    token: it ignores `start` and column alignment, which only move padding)."""

    multi_token_extend: bool  # can run several new columns onto a non-empty cache (needed to share a prompt prefix)

    def allocate(self, rows: int, columns: int) -> None:
        """A fresh, empty cache for `rows` rows of at most `columns` columns."""
        ...

    def select_rows(self, index: torch.Tensor, start: int = 0, columns: int | None = None) -> None:
        """Keep rows `index` [b'] int64 of the current rows, in that order (an index may repeat: copies), and only
        the columns from `start` on (the first `start` columns are padding in every kept row); `columns`: room per
        row from now on (None: unchanged; never fewer than the columns kept)."""
        ...

    def write_rows(self, slots: torch.Tensor, source: KVCache | None, rows: torch.Tensor | None = None,
                   columns: int | None = None) -> None:
        """Rows `slots` [k] int64 of this cache become rows `rows` [k] (default 0..k-1; repeats allowed) of
        `source`, another cache of the same model: its last `columns` columns (default: all it holds; those before
        are padding in the rows copied) go into this cache's last `columns` columns, this cache first growing by
        padding columns in front (every row) if it holds fewer; the slots' columns before them become padding.
        Works on a cache just allocated (no columns yet). source None: the slots hold no tokens from now on (the
        next `run` writes their first; column-aligned caches have nothing to do: `real` says so)."""
        ...

    def run(self, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
        """Write ids [b, n] int64 (the n newest columns) into the cache; real [b, S] bool covers every column so far,
        the n new ones included (True = a token, False = padding). Logits [b, V/tp] at the last new column on the
        output pipeline stage, None on the other stages."""
        ...


def positions(real: torch.Tensor) -> torch.Tensor:
    """real [b, S] bool -> [b, S] int64: each column's position among its row's tokens (padding: 0)."""
    return (real.long().cumsum(dim=1) - 1).clamp(min=0)


def first_token_columns(real: torch.Tensor) -> torch.Tensor:
    """real [b, S] bool -> [b] int64: the column of each row's first token (S for a row without tokens)."""
    any_token = real.any(dim=1)
    return torch.where(any_token, real.long().argmax(dim=1), torch.full_like(any_token, real.shape[1], dtype=torch.long))


class CacheDecoder:
    """Decoding state of one pool of prompts on any `KVCache`: what a backend's `incremental_decoder()` returns
    to nano_eval.generate.greedy_decode, which calls `step` once per decoding step (the first one starts the pool),
    with the same arguments on every rank of the model replica. `prefill`, `extend` and `admit` are its parts.

    Prompts that start with the same `shared_prefix_tokens` (> 0) or more tokens (fixed few-shot examples) share
    them when the cache can extend by several columns: the prefix runs once per pool as a batch of one, its cache is
    copied to every row that starts with it (refills included), and only each prompt's own suffix is prefilled
    (never under lockstep's agreed width: every DP rank's forwards must have the same shapes).

    Memory: the cache holds rows x (the longest live prompt + max_new_tokens) columns (trimmed when full), the budget
    greedy_decode admits rows by (--batch-tokens); a refill's prefill holds its own prompts' columns until they are
    copied into their slots.
    """

    def __init__(self, make_cache: Callable[[], KVCache], shared_prefix_tokens: int = 0):
        self.make_cache = make_cache
        self.cache = make_cache()
        self.shared_prefix_tokens = shared_prefix_tokens if self.cache.multi_token_extend else 0  # 0: never share
        self.refills = getattr(self.cache, "writes_rows", True)  # False: new prompts wait until the pool is empty
        self.real = torch.zeros((0, 0), dtype=torch.bool)  # [b, S]: which columns so far are tokens
        self.need: list[int] = []  # per row: prompt + max_new_tokens, the columns it may reach (0: no live row)
        self.columns = 0  # the cache's room per row
        self.max_new = 0
        self.shared = 0  # length of the prefix the last prefill shared (0: none)
        self.prefix: tuple[tuple[int, ...], KVCache] | None = None  # the pool's shared prefix and its 1-row cache

    @property
    def rows(self) -> int:
        return self.real.shape[0]

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], pad_id: int, max_new_tokens: int,
                width: int | None = None) -> torch.Tensor | None:
        """Start a pool: logits [B, V/tp] at each prompt's last token (output stage; None elsewhere). Prompts are
        left-padded to the longest (or to `width`, lockstep's agreed width, when wider)."""
        self.max_new, self.prefix = max_new_tokens, None
        self.real, self.need = torch.zeros((0, 0), dtype=torch.bool), []
        return self.admit(list(range(len(prompts))), prompts, pad_id, width)

    @torch.no_grad()
    def extend(self, keep: list[int], next_ids: list[int], empty: Sequence[int] = ()) -> torch.Tensor | None:
        """Keep rows `keep` (indices into the current rows, in order), append next_ids[k] to row keep[k]; logits
        [len(keep), V/tp] at the appended tokens (output stage; None elsewhere). Rows at positions `empty` (of
        `keep`) are dead slots (lockstep fillers, slots about to be refilled): their history is dropped first, so
        their token is their only one."""
        if keep != list(range(self.rows)):
            self._reshape([int(k) for k in keep])
        if empty:
            self.cache.write_rows(torch.tensor(empty, dtype=torch.int64), None)
            self.real[list(empty)] = False
            for p in empty:
                self.need[p] = 0
        self._make_room(1)
        self.real = torch.cat([self.real, torch.ones((len(keep), 1), dtype=torch.bool)], dim=1)
        return self._run(self.cache, torch.tensor(next_ids, dtype=torch.int64)[:, None], self.real)

    @torch.no_grad()
    def admit(self, slots: list[int], prompts: list[list[int]], pad_id: int, width: int | None = None,
              batch: int = 0, total: int = 0) -> torch.Tensor | None:
        """Prompts[j] into row slots[j] (a dead row, or a new one at the end); logits [len(prompts), V/tp] at their
        last tokens (output stage; None elsewhere). The prefill is its own forward of max(batch, len(prompts)) rows
        (lockstep: one-token filler prompts after the own ones) left-padded to the longest (or `width`); afterwards
        the cache has max(total, rows, slots + 1) rows (rows that get nothing are dead: empty until they are
        filled). With no live row left outside `slots`, the prefill's cache becomes the pool's (no copy)."""
        fillers = [[pad_id]] * (max(batch, len(prompts)) - len(prompts))
        total = max(total, self.rows, max(slots, default=-1) + 1)
        staying = set(range(self.rows)) - set(slots)
        fresh = not any(self.need[r] for r in staying)
        longest = max(map(len, prompts + fillers), default=1)
        wide = max(longest, width or 0)
        source = self.make_cache()
        logits, real = self._prefill(source, prompts + fillers, pad_id, width, wide + self.max_new if fresh else wide)
        needs = [len(p) + self.max_new for p in prompts]
        if fresh:  # the pool restarts from the prefill's cache: its rows in `slots`, the rest dead
            order = [None] * total
            for j, s in enumerate(slots):
                order[s] = j
            spare = iter(range(len(prompts), real.shape[0]))  # filler rows first, then copies of row 0 as dead rows
            index = [j if j is not None else next(spare, 0) for j in order]
            self.cache, self.real, self.columns = source, real, wide + self.max_new
            self.need = needs + [0] * len(fillers)
            if index != list(range(real.shape[0])):
                self.cache.select_rows(torch.tensor(index, dtype=torch.int64))
                self.real = real[index]
                self.need = [self.need[i] if o is not None else 0 for i, o in zip(index, order)]
            for p, o in enumerate(order):
                if o is None:
                    self.real[p] = False
            return None if logits is None else logits[: len(prompts)]
        room = max([self.need[r] for r in staying] + needs)  # the most columns any row of the pool may reach
        if total > self.rows or room > self.columns:
            self._reshape(list(range(self.rows)) + [None] * (total - self.rows), columns=room)
        if prompts:
            k = len(prompts)
            copied = real.shape[1] - int(first_token_columns(real[:k]).min())
            self.cache.write_rows(torch.tensor(slots, dtype=torch.int64), source, torch.arange(k), copied)
            if copied > self.real.shape[1]:
                self.real = torch.cat([torch.zeros((self.rows, copied - self.real.shape[1]), dtype=torch.bool),
                                       self.real], dim=1)
            self.real[slots] = False
            self.real[slots, -copied:] = real[:k, -copied:]
            for s, n in zip(slots, needs):
                self.need[s] = n
        return None if logits is None else logits[: len(prompts)]

    def step(self, keep: list[int], next_ids: list[int], empty: Sequence[int], slots: list[int],
             prompts: list[list[int]], pad_id: int, total: int, decode: bool = True, width: int | None = None,
             batch: int = 0, columns: int | None = None) -> torch.Tensor | None:
        """One decoding step of greedy_decode: `extend` the kept rows (when `decode`: some row of some rank is live)
        and `admit` the new prompts; logits [total, V/tp] in the new row order (dead rows: zeros; None off the
        output stage). Without `decode` no row holds tokens: the pool restarts from the new prompts' prefill.
        `columns` is the re-run path's (lockstep's agreed forward width), unused here."""
        decoded = self.extend(keep, next_ids, empty) if decode else None
        if not decode:
            self.real, self.need = torch.zeros((0, 0), dtype=torch.bool), []
        added = self.admit(slots, prompts, pad_id, width, batch, total) if prompts or batch or not decode else None
        if not decode and not (prompts or batch):
            return None
        if total > self.rows:  # lockstep: dead rows to make the agreed row count
            self._reshape(list(range(self.rows)) + [None] * (total - self.rows))
        return _assemble(total, decoded, added, slots)

    def _reshape(self, index: list[int | None], columns: int | None = None) -> None:
        """Rows `index` of the current ones (None: a new dead row), the leading columns that are padding in every
        live row dropped; `columns`: the new room per row."""
        placeholder = [i is None for i in index]
        rows = torch.tensor([0 if i is None else i for i in index], dtype=torch.int64)
        real = self.real[rows] if self.rows else torch.zeros((len(index), 0), dtype=torch.bool)
        need = [0 if i is None else self.need[i] for i in index]
        live = [p for p, n in enumerate(need) if n]
        start = int(first_token_columns(real[live]).min()) if live else real.shape[1]
        start = start if self.refills else 0  # a cache that cannot write rows keeps its columns (and its room)
        self.cache.select_rows(rows, start=start, columns=columns)
        self.real, self.need = real[:, start:].clone(), need
        self.real[placeholder] = False
        self.columns = columns or self.columns

    def _make_room(self, n: int) -> None:
        """Drop leading padding columns when `n` more would not fit."""
        if self.real.shape[1] + n > self.columns:
            self._reshape(list(range(self.rows)))

    def _run(self, cache: KVCache, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
        limit = self.columns if cache is self.cache else real.shape[1]
        if real.shape[1] > limit:
            raise RuntimeError(f"KV cache of {limit} columns is full: more tokens than the max_new_tokens "
                               "given to prefill")
        return cache.run(ids, real)

    def _prefill(self, cache: KVCache, prompts: list[list[int]], pad_id: int, width: int | None,
                 columns: int) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Prompts into the fresh `cache` (room `columns`): (logits at their last tokens, real [k, S])."""
        self.shared = 0 if width else self._shared_length(prompts)
        cache.allocate(len(prompts), columns)
        prefix = torch.ones((len(prompts), self.shared), dtype=torch.bool)
        if self.shared:
            cache.write_rows(torch.arange(len(prompts)), self.prefix[1], torch.zeros(len(prompts), dtype=torch.int64))
        ids, real = left_padded([p[self.shared:] for p in prompts], pad_id, width)
        real = torch.cat([prefix, real], dim=1)
        if real.shape[1] > columns:
            raise RuntimeError(f"KV cache of {columns} columns is full: prompts of {real.shape[1]} columns")
        return cache.run(ids, real), real

    def _shared_length(self, prompts: list[list[int]]) -> int:
        """Tokens every prompt starts with, leaving each at least one of its own; 0 when under the threshold. The
        pool's prefix cache is kept for later refills (and replaced when the prompts share another prefix)."""
        if not self.shared_prefix_tokens or not prompts:
            return 0
        if self.prefix is not None:
            tokens = self.prefix[0]
            if all(len(p) > len(tokens) and common_prefix_length(tokens, p) == len(tokens) for p in prompts):
                return len(tokens)
        if len(prompts) < 2:
            return 0
        first, n = prompts[0], min(len(p) for p in prompts) - 1
        for p in prompts[1:]:
            n = common_prefix_length(first, p, n)
        if n < self.shared_prefix_tokens:
            return 0
        cache = self.make_cache()  # the prefix, once, as a batch of one
        cache.allocate(1, n)
        cache.run(torch.tensor([first[:n]], dtype=torch.int64), torch.ones((1, n), dtype=torch.bool))
        self.prefix = (tuple(first[:n]), cache)
        return n


def _assemble(total: int, decoded: torch.Tensor | None, added: torch.Tensor | None,
              slots: list[int]) -> torch.Tensor | None:
    """Logits [total, V/tp]: the kept rows' (`decoded`, rows 0..) and the new prompts' (`added`, at `slots`);
    zeros elsewhere; None off the output stage."""
    some = decoded if decoded is not None else added
    if some is None:
        return None
    out = some.new_zeros((total, some.shape[-1]))
    if decoded is not None:
        out[: decoded.shape[0]] = decoded
    if added is not None and slots:
        out[torch.tensor(slots, device=out.device)] = added
    return out
