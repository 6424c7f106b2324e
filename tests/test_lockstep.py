"""nano_eval.lockstep's pure parts and lockstep decoding on one process (the toy transformers model). The multi-rank
runs (MoE under expert parallelism, uneven shards, both dispatchers) are in tests/test_megatron_moe.py."""

import torch

from nano_eval.engine import BatchingConfig, Engine
from nano_eval.generate import greedy_decode
from nano_eval.lockstep import Lockstep, agree_generation, agree_scoring, padded_batch
from nano_eval.parallel import ParallelLayout
from nano_eval.rows import make_batch, plain_row
from nano_eval.tasks.requests import GreedyUntilRequest


def test_agreed_shapes_cover_every_rank():
    """[batch index][rank]; a rank without a batch at an index counts as zeros."""
    assert agree_scoring([[(3, 10), (2, 12)], [(2, 8), (0, 0)]]) == [(3, 12), (2, 8)]
    # rank 0: 2 rows, longest prompt 10; rank 1: 3 rows of at most 7 tokens -> a 10-token filler: 4 rows
    assert agree_generation([[(2, 10, 12), (3, 7, 5)], [(0, 0, 0), (1, 4, 5)]]) == [(4, 10, 12), (1, 4, 5)]
    assert agree_generation([[(2, 10, 12), (2, 10, 5)]]) == [(2, 10, 12)]  # same widths: no filler


def test_padded_batch_keeps_scored_positions():
    rows = [plain_row("a", [5, 6, 7], [8, 9]), plain_row("b", [1], [2])]
    batch = make_batch(rows, 0, with_mask=False)
    padded = padded_batch(batch, 4, 9, pad_id=0)
    assert padded.input_ids.shape == (4, 9) and torch.equal(padded.input_ids[:2, :4], batch.input_ids)
    assert int(padded.input_ids[2:].sum()) == 0 and int(padded.attention_mask.sum()) == int(batch.attention_mask.sum())
    assert torch.equal(padded.rows, batch.rows) and torch.equal(padded.cols, batch.cols)
    assert padded_batch(batch, 2, 4, 0) is batch
    dummy = padded_batch(None, 3, 5, pad_id=7)
    assert dummy.input_ids.shape == (3, 5) and int(dummy.attention_mask.sum()) == 0 and dummy.rows.tolist() == [0]


def test_lockstep_fillers_make_the_agreed_shape():
    engine_rows = [plain_row("a", [1, 2, 3], [4])]
    step = Lockstep.of(engine_rows, (3, 6, 8), pad_id=0, layout=ParallelLayout())
    assert step.fillers == [[0] * 6, [0]] and step.max_new_tokens == 8
    assert Lockstep.of(engine_rows, (2, 3, 8), 0, ParallelLayout()).fillers == [[0]]  # already as wide
    assert Lockstep.of([], (2, 5, 4), 0, ParallelLayout()).fillers == [[0] * 5, [0]]  # a dummy batch


class _Counted:
    """The toy backend without its decoder (generation re-runs prompts), counting the shapes of its forwards."""

    def __init__(self, backend):
        self.layout, self.tokenizer, self.max_length, self.module = (backend.layout, backend.tokenizer,
                                                                     backend.max_length, backend.module)
        self._forward, self.shapes = backend.forward, []

    def forward(self, batch):
        self.shapes.append(tuple(batch.input_ids.shape))
        return self._forward(batch)


def test_lockstep_decoding_gives_the_same_generations(toy_backend):
    """With fillers and more steps than the batch needs, finished rows keep decoding (every forward has all rows,
    one more column each step), the loop ends when no row is unfinished, and the results are the plain decode's."""
    engine = Engine(toy_backend, BatchingConfig(), progress=False)
    requests = [GreedyUntilRequest("t", i, 0, p, stop_sequence=["e"], generation_size=6)
                for i, p in enumerate(["The cat", "One two three four", "a"])]
    rows = [engine.prepare_greedy(requests)[i] for i in range(3)]
    args = (engine.pad_id, engine.tokens.eos_ids, engine._vocab_shard)
    plain_backend, lockstep_backend = _Counted(toy_backend), _Counted(toy_backend)
    with torch.no_grad():
        plain = greedy_decode(plain_backend, rows, *args)
        width = max(len(r.segments[0].context) for r in rows) + 2
        lockstep = Lockstep.of(rows, (5, width, 9), engine.pad_id, toy_backend.layout)
        stepped = greedy_decode(lockstep_backend, rows, *args, lockstep=lockstep)
        cached = greedy_decode(toy_backend, rows, *args, lockstep=lockstep)  # the KV-cache decoder, no row dropped
    assert stepped == plain and cached == plain
    assert len({len(g.tokens) for g in plain.values()}) > 1  # rows finished at different steps
    shapes = lockstep_backend.shapes
    assert shapes == [(5, width + k) for k in range(len(shapes))]  # all rows, widening by one column per step
    assert len(shapes) == len(plain_backend.shapes) < 9  # ends with the last unfinished row, not at 9 steps
    assert [b for b, _ in plain_backend.shapes] != [3] * len(shapes)  # the plain decode drops finished rows
