"""nano_eval.lockstep's pure parts and lockstep decoding on one process (the toy transformers model). The multi-rank
runs (MoE under expert parallelism, uneven shards, both dispatchers) are in tests/test_megatron_moe.py."""

import random

import torch

from nano_eval.engine import BatchingConfig, Engine
from nano_eval.generate import greedy_decode
from nano_eval.lockstep import Lockstep, padded_batch, plan_generation, plan_scoring
from nano_eval.parallel import ParallelLayout
from nano_eval.rows import make_batch, plain_row
from nano_eval.tasks.requests import GreedyUntilRequest


def test_agreed_shapes_cover_every_rank():
    """[rank][batch] shapes -> steps: batch i of every rank together, at the most rows / columns of any rank."""
    steps = plan_scoring([[(3, 10), (2, 8)], [(2, 12)]], max_tokens=1000)
    assert [(s.shape, s.start, s.batch) for s in steps] == [((3, 12), 0, (0, 0)), ((2, 8), 0, (1, None))]
    a, b = (5, ("e",)), (9, ())  # generation settings: (max new tokens, stop)
    steps = plan_generation([[(b, 2, 10, 9), (a, 3, 7, 5)], [(a, 1, 4, 5)]], max_tokens=1000)
    # matched by settings (rank 1's only batch is rank 0's second one), not by position
    assert [(s.shape, s.batch) for s in steps] == [((3, 7, 5), (1, 0)), ((2, 10, 9), (0, None))]


def test_lockstep_steps_stay_within_the_budget():
    """The issue's case: one rank holds 5 long prompts, the other 60 short ones, with two generation settings; at
    a budget of 300 positions the old position-matched plan ran one forward of 3,520. Every step now fits (a row
    wider than the budget alone) and every row of every rank runs exactly once."""
    rng = random.Random(0)
    for trial in range(200):
        budget = rng.choice([64, 300, 1000, 8192])
        every = []
        for rank in range(rng.choice([2, 3, 8])):
            shapes = []
            for _ in range(rng.randrange(0, 6)):
                new = rng.choice([4, 32, 256])
                width = rng.randrange(1, 700)
                shapes.append(((new, ("\n",)), max(1, budget // (width + new)), width, new))
            every.append(shapes)
        if not any(every):
            continue
        steps = plan_generation(every, budget)
        for s in steps:
            rows, width, new = s.shape
            assert rows == 1 or rows * (width + new) <= budget, (trial, s)
        for rank, shapes in enumerate(every):
            ran = sorted((s.batch[rank], row) for s in steps if s.batch[rank] is not None
                         for row in range(s.start, min(s.start + s.shape[0], shapes[s.batch[rank]][1])))
            assert ran == sorted((b, row) for b, shape in enumerate(shapes) for row in range(shape[1])), trial
        scoring = [[(r, c) for _, r, c, _ in shapes] for shapes in every]
        for s in plan_scoring(scoring, budget):
            assert s.shape[0] == 1 or s.shape[0] * s.shape[1] <= budget
    # the numbers of the issue: 5 prompts of 600 tokens + 32 new vs 60 of 4 tokens + 1 new, budget 300
    steps = plan_generation([[((32, ()), 5, 600, 32)], [((1, ()), 60, 4, 1)]], 300)
    assert max(s.shape[0] * (s.shape[1] + s.shape[2]) for s in steps) == 632  # one row alone (wider than 300)
    assert all(s.shape[0] == 1 or s.shape[0] * (s.shape[1] + s.shape[2]) <= 300 for s in steps)


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
    assert step.fillers == [[0], [0]] and step.width == 6 and step.max_new_tokens == 8
    assert Lockstep.of(engine_rows, (1, 3, 8), 0, ParallelLayout()).fillers == []
    assert Lockstep.of([], (2, 5, 4), 0, ParallelLayout()).fillers == [[0], [0]]  # a dummy batch


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
    """With fillers, a wider agreed prompt width and more steps than the batch needs, finished rows keep decoding
    (every forward has all rows, one more column each step), the loop ends when no row is unfinished, and the
    results are the plain decode's (the KV-cache decoder's too, its prompts left-padded to the agreed width)."""
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
