"""nano_eval.decoder.CacheDecoder: the row bookkeeping every framework's KV cache shares, on transformers' real cache.

The framework part is wrapped to record what the driver asks of it (allocate / select rows / run), so the tests see
the contract a framework implements: capacity, left padding and the `real` mask, rows selected only when some
finish, a shared prefix run once and copied, and a full cache refused. The nanotron and Megatron caches are checked
against their re-run paths in tests/test_nanotron.py and tests/test_megatron.py.
"""

from __future__ import annotations

import pytest
import torch

from nano_eval.backends.transformers import TransformersCache
from nano_eval.decoder import CacheDecoder, positions


class Recorded(TransformersCache):
    def __init__(self, backend):
        super().__init__(backend)
        self.calls = []

    def allocate(self, rows, columns):
        self.calls.append(("allocate", rows, columns))
        super().allocate(rows, columns)

    def select_rows(self, index):
        self.calls.append(("select", index.tolist()))
        super().select_rows(index)

    def run(self, ids, real):
        assert ids.dtype == torch.int64 and real.dtype == torch.bool and real.shape[0] == ids.shape[0]
        self.calls.append(("run", tuple(ids.shape), real.clone()))
        return super().run(ids, real)


def _alone(backend, prompt):
    with torch.no_grad():
        return backend.model(torch.tensor([prompt])).logits[0, -1]


def test_positions_count_real_tokens_only():
    real = torch.tensor([[False, False, True, True], [True, False, True, True]])
    assert positions(real).tolist() == [[0, 0, 0, 1], [0, 0, 1, 2]]


def test_prefill_left_pads_sizes_the_cache_and_rows_are_selected_only_when_some_finish(toy_backend):
    cache = Recorded(toy_backend)
    decoder = CacheDecoder(cache)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    logits = decoder.prefill(prompts, 0, 3)
    assert cache.calls[0] == ("allocate", 3, 5 + 3)
    _, shape, real = cache.calls[1]
    assert shape == (3, 5) and real.sum(dim=1).tolist() == [5, 2, 3] and bool(real[:, -1].all())
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], _alone(toy_backend, prompt), atol=1e-5, rtol=1e-5)

    decoder.extend([0, 1, 2], [20, 21, 22])  # nobody finished: no row selection
    assert [c[0] for c in cache.calls] == ["allocate", "run", "run"]
    step = decoder.extend([2, 0], [23, 24])  # row 1 finished; the order is the caller's
    assert cache.calls[3] == ("select", [2, 0])
    torch.testing.assert_close(step[0], _alone(toy_backend, prompts[2] + [22, 23]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1], _alone(toy_backend, prompts[0] + [20, 24]), atol=1e-5, rtol=1e-5)
    decoder.extend([0, 1], [1, 1])  # the third new token: the cache's last column
    with pytest.raises(RuntimeError, match="KV cache of 8 columns is full"):
        decoder.extend([0, 1], [1, 1])


def test_a_shared_prefix_runs_once_and_is_copied_to_every_row(toy_backend):
    cache = Recorded(toy_backend)
    prefix = list(range(40, 80))
    prompts = [prefix + [5, 6], prefix + [7], prefix + [8, 9, 10]]
    logits = CacheDecoder(cache, shared_prefix_tokens=32).prefill(prompts, 0, 2)
    kinds = [c[0] for c in cache.calls]
    assert kinds == ["allocate", "run", "select", "run"]
    assert cache.calls[1][1] == (1, 40) and cache.calls[2][1] == [0, 0, 0]
    assert cache.calls[3][1] == (3, 3)  # suffixes only, left-padded: [prefix | padding | suffix]
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], _alone(toy_backend, prompt), atol=1e-4, rtol=1e-4)


def test_under_lockstep_width_prompts_fill_the_agreed_width_and_share_nothing(toy_backend):
    cache = Recorded(toy_backend)
    prefix = list(range(40, 80))
    CacheDecoder(cache, shared_prefix_tokens=32).prefill([prefix + [5], prefix + [6]], 0, 2, width=50)
    assert [c[0] for c in cache.calls] == ["allocate", "run"]
    assert cache.calls[0] == ("allocate", 2, 52) and cache.calls[1][1] == (2, 50)
