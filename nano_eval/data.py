"""Batching: sort by token length, shard over data-parallel ranks, cut batches by a token budget.

Items are sorted longest first so each batch pads only to its own longest row and out-of-memory shows up on the
first batch. The order of items (and so every rank's shard) is a pure function of the requests, never of timing.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

from nano_eval.rows import Row


class DynamicBatchDataset:
    """Items sorted by length (longest first, stable on ties) with batches cut by a padded-token budget."""

    def __init__(self, items: Sequence, length_fn: Callable[[Any], int]):
        self.items = list(items)
        self.length_fn = length_fn
        order = sorted(range(len(self.items)), key=lambda i: (-length_fn(self.items[i]), i))
        self.sorted_items = [self.items[i] for i in order]
        self.original_index = order  # sorted position -> original position

    def __len__(self) -> int:
        return len(self.sorted_items)

    def __getitem__(self, i: int):
        return self.sorted_items[i]

    def splits_iterator(self, indices: Sequence[int], max_tokens: int, max_batch_size: int,
                        max_padding: float = 1.0) -> Iterator[list[int]]:
        """Yield batches of sorted positions (taken from `indices`, already longest first) within the budget.

        A batch holds rows while rows x longest_row <= max_tokens (always at least one row) and every row is at least
        (1 - max_padding) x the longest (so right padding is at most that share of the batch's positions).
        """
        batch: list[int] = []
        longest = 0
        for i in indices:
            length = self.length_fn(self.sorted_items[i])
            longest = max(longest, length)
            if batch and ((len(batch) + 1) * longest > max_tokens or len(batch) >= max_batch_size
                          or length < (1 - max_padding) * longest):
                yield batch
                batch, longest = [], length
            batch.append(i)
        if batch:
            yield batch

    def get_original_order(self, sorted_results: Sequence) -> list:
        """Put results given in sorted order back in the items' original order; raise if any is missing."""
        if len(sorted_results) != len(self.sorted_items):
            raise RuntimeError(f"expected {len(self.sorted_items)} results, got {len(sorted_results)}")
        out: list = [None] * len(self.sorted_items)
        for pos, result in enumerate(sorted_results):
            if result is None:
                raise RuntimeError(f"result missing for item {self.original_index[pos]} (sorted position {pos})")
            out[self.original_index[pos]] = result
        return out


class LoglikelihoodDataset(DynamicBatchDataset):
    """Rows to score (nano_eval.rows), sorted by total length."""

    def __init__(self, items: Sequence[Row]):
        super().__init__(items, length_fn=lambda item: item.length)


class LoglikelihoodSingleTokenDataset(LoglikelihoodDataset):
    """Rows whose continuations are single tokens: one forward scores every choice at the last position."""


class GenerativeTaskDataset(DynamicBatchDataset):
    """Generation rows (prompt-only rows with `generation` set) sorted by prompt + generation budget; batches never
    mix generation settings.

    A batch holds rows while rows x (longest prompt + generation budget) <= max_tokens: that is the KV cache the
    decoders hold (each row's columns, the copies of a shared prompt prefix included: see
    nano_eval.decoder.CacheDecoder), so --batch-tokens bounds generation memory as it bounds scoring.
    """

    def __init__(self, items: Sequence[Row]):
        super().__init__(items, length_fn=lambda row: row.input_len + row.generation.max_new_tokens)

    def splits_iterator(self, indices: Sequence[int], max_tokens: int, max_batch_size: int,
                        max_padding: float = 1.0) -> Iterator[list[int]]:
        groups: dict[tuple, list[int]] = {}
        for i in indices:
            groups.setdefault(self.sorted_items[i].generation, []).append(i)
        for group_indices in groups.values():
            yield from super().splits_iterator(group_indices, max_tokens, max_batch_size, max_padding)


class GenerativeTaskDatasetNanotron(GenerativeTaskDataset):
    """Name kept for lighteval compatibility; the nanotron backend batches generation like every other backend."""


class GenDistributedSampler:
    """Shard sorted positions over data-parallel replicas: rank r takes positions r, r + dp, r + 2dp, ...

    Interleaving keeps every shard's length profile alike (so ranks finish together). Shards are padded with
    repeats of the last (shortest) position so that all ranks see the same number of rows; results of repeats carry the
    same request key and collapse when gathered.
    """

    def __init__(self, dataset: DynamicBatchDataset, num_replicas: int, rank: int):
        self.dataset, self.num_replicas, self.rank = dataset, num_replicas, rank
        self.num_samples = math.ceil(len(dataset) / num_replicas) if len(dataset) else 0

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        positions = list(range(n)) + [n - 1] * (self.num_samples * self.num_replicas - n)
        return iter(positions[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
