"""Sorting, token-budget batches, order restoration and data-parallel sharding."""

import pytest

from nano_eval.data import GenDistributedSampler, GenerativeTaskDataset, LoglikelihoodDataset
from nano_eval.rows import Generation, last_position_row, plain_row


def _items(lengths):
    return [plain_row(i, list(range(n - 1)), [n - 1]) for i, n in enumerate(lengths)]  # rows of n tokens


def _key(row):
    return row.segments[0].choices[0].key


def test_sorted_longest_first_and_stable():
    ds = LoglikelihoodDataset(_items([3, 9, 5, 9, 1]))
    assert [_key(it) for it in ds.sorted_items] == [1, 3, 2, 0, 4]


def test_batches_respect_token_budget_and_pad_to_own_longest():
    ds = LoglikelihoodDataset(_items([10, 8, 8, 4, 4, 4, 4, 2]))
    batches = list(ds.splits_iterator(range(len(ds)), max_tokens=16, max_batch_size=100))
    for b in batches:
        assert len(b) == 1 or len(b) * max(ds[i].length for i in b) <= 16
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert batches[0] == [0]  # 10 tokens: a second row would need 20
    assert list(ds.splits_iterator(range(8), max_tokens=1000, max_batch_size=3))[0] == [0, 1, 2]


def test_max_padding_bounds_each_batchs_right_padding():
    """Rows shorter than (1 - max_padding) x the batch's longest start a new batch, whatever the token budget."""
    lengths = [100, 90, 80, 76, 74, 60, 40, 39, 10, 9, 2]
    ds = LoglikelihoodDataset(_items(lengths))
    batches = list(ds.splits_iterator(range(len(ds)), max_tokens=10_000, max_batch_size=100, max_padding=0.25))
    assert [[ds[i].length for i in b] for b in batches] == [[100, 90, 80, 76], [74, 60], [40, 39], [10, 9], [2]]
    for b in batches:
        longest = max(ds[i].length for i in b)
        assert sum(longest - ds[i].length for i in b) <= 0.25 * longest * len(b)
    assert len(list(ds.splits_iterator(range(len(ds)), max_tokens=10_000, max_batch_size=100))) == 1  # unbounded


def test_get_original_order_restores_and_raises_on_missing():
    ds = LoglikelihoodDataset(_items([3, 9, 5]))
    assert ds.get_original_order([_key(ds[i]) for i in range(3)]) == [0, 1, 2]
    with pytest.raises(RuntimeError, match="missing"):
        ds.get_original_order([1, None, 0])


@pytest.mark.parametrize("n, world", [(10, 3), (2, 4), (8, 2), (0, 2)])
def test_sampler_covers_everything_with_equal_shard_sizes(n, world):
    ds = LoglikelihoodDataset(_items(range(1, n + 1)))
    shards = [list(GenDistributedSampler(ds, world, r)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    assert set().union(*map(set, shards)) == set(range(n))


def test_generative_batches_never_mix_generation_settings():
    items = [last_position_row(i, [1] * 5, generation=Generation(4, (g,))) for i, g in enumerate("abab")]
    ds = GenerativeTaskDataset(items)
    for b in ds.splits_iterator(range(4), max_tokens=1000, max_batch_size=10):
        assert len({ds[i].generation for i in b}) == 1


def test_generation_batches_count_every_rows_cache_shared_prefix_or_not():
    """Prompts with a 100-token common prefix and 10 own tokens, 20 new tokens each: every row holds 130 cache
    columns (a shared prefix is copied into each row's cache), so a 400-token budget takes 3 rows a batch."""
    gen = Generation(20, ())
    prefix = list(range(1000, 1100))
    items = [last_position_row(i, prefix + [i] * 10, generation=gen) for i in range(12)]
    assert [len(b) for b in GenerativeTaskDataset(items).splits_iterator(range(12), 400, 100)] == [3, 3, 3, 3]
    assert [len(b) for b in GenerativeTaskDataset(items).splits_iterator(range(12), 400, 2)] == [2] * 6
