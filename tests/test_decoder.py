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
    """TransformersCache logging every call into `calls` (shared by every cache the decoder makes)."""

    def __init__(self, backend, calls):
        super().__init__(backend)
        self.calls = calls
        self.name = sum(1 for c in calls if c[0] == "new")
        calls.append(("new", self.name))

    def allocate(self, rows, columns):
        self.calls.append(("allocate", rows, columns))
        super().allocate(rows, columns)

    def select_rows(self, index, start=0, columns=None):
        self.calls.append(("select", index.tolist(), start, columns))
        super().select_rows(index, start, columns)

    def write_rows(self, slots, source, rows=None, columns=None):
        self.calls.append(("write", slots.tolist(), None if source is None else source.name, columns))
        super().write_rows(slots, source, rows, columns)

    def run(self, ids, real):
        assert ids.dtype == torch.int64 and real.dtype == torch.bool and real.shape[0] == ids.shape[0]
        self.calls.append(("run", tuple(ids.shape), real.clone()))
        return super().run(ids, real)


def _decoder(backend, shared_prefix_tokens=0):
    calls = []
    return CacheDecoder(lambda: Recorded(backend, calls), shared_prefix_tokens), calls


def _kinds(calls):
    return [c[0] for c in calls if c[0] != "new"]


def _alone(backend, prompt):
    with torch.no_grad():
        return backend.model(torch.tensor([prompt])).logits[0, -1]


def test_positions_count_real_tokens_only():
    real = torch.tensor([[False, False, True, True], [True, False, True, True]])
    assert positions(real).tolist() == [[0, 0, 0, 1], [0, 0, 1, 2]]


def test_prefill_left_pads_sizes_the_cache_and_rows_are_selected_only_when_some_finish(toy_backend):
    decoder, calls = _decoder(toy_backend)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    logits = decoder.prefill(prompts, 0, 3)
    calls[:] = [c for c in calls if c[0] != "new"]
    assert calls[0] == ("allocate", 3, 5 + 3)
    _, shape, real = calls[1]
    assert shape == (3, 5) and real.sum(dim=1).tolist() == [5, 2, 3] and bool(real[:, -1].all())
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], _alone(toy_backend, prompt), atol=1e-5, rtol=1e-5)

    decoder.extend([0, 1, 2], [20, 21, 22])  # nobody finished: no row selection
    assert [c[0] for c in calls] == ["allocate", "run", "run"]
    step = decoder.extend([2, 0], [23, 24])  # row 1 finished; the order is the caller's
    assert calls[3] == ("select", [2, 0], 0, None)  # row 0's prompt starts in column 0: nothing to trim
    torch.testing.assert_close(step[0], _alone(toy_backend, prompts[2] + [22, 23]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1], _alone(toy_backend, prompts[0] + [20, 24]), atol=1e-5, rtol=1e-5)
    decoder.extend([0, 1], [1, 1])  # the third new token: the cache's last column
    with pytest.raises(RuntimeError, match="KV cache of 8 columns is full"):
        decoder.extend([0, 1], [1, 1])


def test_a_shared_prefix_runs_once_and_is_copied_to_every_row(toy_backend):
    decoder, calls = _decoder(toy_backend, shared_prefix_tokens=32)
    prefix = list(range(40, 80))
    prompts = [prefix + [5, 6], prefix + [7], prefix + [8, 9, 10]]
    logits = decoder.prefill(prompts, 0, 2)
    assert _kinds(calls) == ["allocate", "run", "allocate", "write", "run"]
    calls = [c for c in calls if c[0] != "new"]
    assert calls[0] == ("allocate", 1, 40) and calls[1][1] == (1, 40)  # the prefix, once, in a cache of its own
    assert calls[3][1] == [0, 1, 2] and calls[3][2] is not None  # copied into every row of the pool's cache
    assert calls[4][1] == (3, 3)  # suffixes only, left-padded: [prefix | padding | suffix]
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(logits[row], _alone(toy_backend, prompt), atol=1e-4, rtol=1e-4)


def test_under_lockstep_width_prompts_fill_the_agreed_width_and_share_nothing(toy_backend):
    decoder, calls = _decoder(toy_backend, shared_prefix_tokens=32)
    prefix = list(range(40, 80))
    decoder.prefill([prefix + [5], prefix + [6]], 0, 2, width=50)
    calls = [c for c in calls if c[0] != "new"]
    assert [c[0] for c in calls] == ["allocate", "run"]
    assert calls[0] == ("allocate", 2, 52) and calls[1][1] == (2, 50)


def test_a_freed_slot_takes_the_next_prompt_in_place(toy_backend):
    """Row 1 finishes; the next prompt is prefilled as a batch of its own and copied into row 1 (no row
    selection: the cache is written in place), right-aligned with the other rows' newest tokens. Every row's logits,
    then and after more steps, are its own sequence's alone."""
    decoder, calls = _decoder(toy_backend)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    decoder.prefill(prompts, 0, 4)
    decoder.extend([0, 1, 2], [20, 21, 22])
    calls.clear()
    kept = decoder.extend([0, 1, 2], [23, 0, 24], empty=[1])  # row 1 is dead: it decodes a filler, then is refilled
    newcomer = [30, 31, 32, 33, 34]  # as long as the longest first prompt: it fits the room
    added = decoder.admit([1], [newcomer], 0)
    assert "select" not in _kinds(calls) and ("write", [1], None, None) in calls
    write = next(c for c in calls if c[0] == "write" and c[2] is not None)
    assert write[1] == [1] and write[3] == len(newcomer)
    torch.testing.assert_close(kept[0], _alone(toy_backend, prompts[0] + [20, 23]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kept[2], _alone(toy_backend, prompts[2] + [22, 24]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(added[0], _alone(toy_backend, newcomer), atol=1e-5, rtol=1e-5)
    assert decoder.real[1].tolist() == [False, False] + [True] * 5
    for t in range(2):  # more steps (row 0 up to its 4 new tokens): each row still sees exactly its own tokens
        step = decoder.extend([0, 1, 2], [40 + t, 50 + t, 60 + t])
        torch.testing.assert_close(step[1], _alone(toy_backend, newcomer + [50 + i for i in range(t + 1)]),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(step[0], _alone(toy_backend, prompts[0] + [20, 23] + [40 + i for i in range(t + 1)]),
                                   atol=1e-5, rtol=1e-5)


def test_a_full_cache_drops_the_columns_every_live_row_holds_as_padding(toy_backend):
    """Refills keep a pool going past its first prompts' prompt + max_new columns: when the cache is full, the
    leading columns that are padding in every live row are dropped (one row selection with `start`), and the rows'
    logits do not change."""
    decoder, calls = _decoder(toy_backend)
    first = [[5, 6, 7, 8, 9, 10], [11, 12]]
    decoder.prefill(first, 0, 2)  # room: 6 + 2 columns
    decoder.extend([0, 1], [20, 0], empty=[1])
    decoder.admit([1], [[30, 31, 32]], 0)  # row 1 is now [30, 31, 32] at columns 4..6
    step = decoder.extend([0, 1], [0, 33], empty=[0])  # row 0 finished after its 2 new tokens; row 1 goes on
    assert decoder.real.shape[1] == 8
    calls.clear()
    step = decoder.extend([0, 1], [0, 34], empty=[0])  # the ninth column does not fit: columns 0..3 go
    assert [c for c in calls if c[0] == "select"] == [("select", [0, 1], 4, None)] and decoder.real.shape[1] == 5
    torch.testing.assert_close(step[1], _alone(toy_backend, [30, 31, 32, 33, 34]), atol=1e-5, rtol=1e-5)


def test_rows_grow_when_shorter_prompts_leave_room(toy_backend):
    """New rows at the end: the cache gets placeholder rows (copies of row 0, marked empty) with room for the
    newcomers, then the prompts are written into them."""
    decoder, calls = _decoder(toy_backend)
    decoder.prefill([[5, 6, 7, 8]], 0, 3)
    decoder.extend([0], [9])
    calls.clear()
    added = decoder.admit([1, 2], [[10, 11], [12, 13, 14]], 0)
    select = next(c for c in calls if c[0] == "select")
    assert select[1] == [0, 0, 0] and decoder.rows == 3 and decoder.need == [7, 5, 6]
    torch.testing.assert_close(added[1], _alone(toy_backend, [12, 13, 14]), atol=1e-5, rtol=1e-5)
    step = decoder.extend([0, 1, 2], [1, 2, 3])
    for row, seq in enumerate([[5, 6, 7, 8, 9, 1], [10, 11, 2], [12, 13, 14, 3]]):
        torch.testing.assert_close(step[row], _alone(toy_backend, seq), atol=1e-5, rtol=1e-5)
