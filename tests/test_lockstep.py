"""nano_eval.lockstep's pure parts, the continuous-batching plan (nano_eval.generate.plan_step) simulated over
several ranks, and lockstep decoding on one process (the toy transformers model, beside a scripted peer rank). The
multi-rank runs (MoE under expert parallelism, uneven shards, both dispatchers) are in tests/test_megatron_moe.py."""

import random

import pytest
import torch

from nano_eval.agreement import Agreement
from nano_eval.engine import BatchingConfig, Engine
from nano_eval.generate import greedy_decode, plan_step, simulate
from nano_eval.lockstep import generation_pools, padded_batch, plan_scoring
from nano_eval.parallel import ParallelLayout
from nano_eval.rows import Generation, last_position_row, make_batch, plain_row
from nano_eval.tasks.requests import GreedyUntilRequest


def test_agreed_shapes_cover_every_rank():
    """[rank][batch] shapes -> steps: batch i of every rank together, at the most rows / columns of any rank."""
    steps = plan_scoring([[(3, 10), (2, 8)], [(2, 12)]], max_tokens=1000)
    assert [(s.shape, s.start, s.batch) for s in steps] == [((3, 12), 0, (0, 0)), ((2, 8), 0, (1, None))]


def test_generation_pools_are_one_per_setting_in_one_order():
    rows = {g: [last_position_row(k, [1, 2], 0, g)] for k, g in enumerate([Generation(9, ()), Generation(5, ("e",))])}
    pools = generation_pools(list(rows.values()), ParallelLayout(), 1000)
    assert [key for _, key in pools] == [(5, ("e",)), (9, ())]  # sorted settings: the same order on every rank
    assert [rows_[0].generation for rows_, _ in pools] == [Generation(5, ("e",)), Generation(9, ())]


def _simulate(ranks, budget: int, max_rows: int = 512, max_new: int = 8):
    """nano_eval.generate.simulate over ranks [rank] (prompt lengths, longest first; answer lengths) -> (forwards
    [(kind, rows, columns)], per rank the prompts in admission order, per rank the largest rows x longest live
    prompt + max_new, steps)."""
    forwards, orders, peaks, rows, steps = [], [[] for _ in ranks], [0] * len(ranks), 0, 0
    prompts, answers = [lengths for lengths, _ in ranks], [a for _, a in ranks]
    for plan, slots in simulate(prompts, answers, max_new, budget, max_rows):
        steps += 1
        if plan.decode:
            forwards.append(("decode", min(rows, plan.rows), 1))
        if plan.batch:
            forwards.append(("prefill", plan.batch, plan.width))
        rows = plan.rows
        for rank, rank_slots in enumerate(slots):
            assert len(rank_slots) == rows  # every rank holds the same rows
            orders[rank] += [i for i in rank_slots if i is not None and i not in orders[rank]]
            live = [prompts[rank][i] + max_new for i in rank_slots if i is not None]
            peaks[rank] = max(peaks[rank], rows * max(live, default=0))
    return forwards, orders, peaks, steps


def test_lockstep_steps_stay_within_the_budget():
    """Random shards (ranks with many short prompts, few long ones, none; skewed answer lengths), as the engine
    gives them (longest first): every rank runs the same forwards; every decode forward and refill prefill, and
    every rank's cache (rows x longest live prompt + max_new), fits the budget (a prompt wider than the budget
    runs alone); every prompt is admitted once, in order; the pool shrinks as rows finish when nothing waits."""
    rng = random.Random(0)
    for trial in range(300):
        budget = rng.choice([64, 300, 1000, 8192])
        max_new = rng.choice([1, 4, 32])
        ranks = []
        for _ in range(rng.choice([1, 2, 3, 8])):
            n = rng.choice([0, 1, 5, 30])
            lengths = sorted((rng.randrange(1, rng.choice([8, 100, 700])) for _ in range(n)), reverse=True)
            answers = [rng.choice([1, 2, max_new]) if rng.random() < 0.8 else max_new for _ in range(n)]
            ranks.append((lengths, [min(a, max_new) for a in answers]))
        if not any(lengths for lengths, _ in ranks):
            continue
        forwards, orders, peaks, _ = _simulate(ranks, budget, max_new=max_new)
        too_wide = any(n + max_new > budget for lengths, _ in ranks for n in lengths)
        for kind, rows, columns in forwards:
            assert rows == 1 or rows * (columns + (max_new if kind == "decode" else 0)) <= budget or too_wide or \
                kind == "decode", (trial, kind, rows, columns)
        for (lengths, _), order, peak in zip(ranks, orders, peaks):
            assert order == list(range(len(lengths))), trial
            assert peak <= budget or too_wide, (trial, peak)
    # the case that made lockstep plan by settings: 5 prompts of 600 tokens on one rank, 60 of 4 on the other
    forwards, _, peaks, _ = _simulate([([600] * 5, [32] * 5), ([4] * 60, [1] * 60)], 300, max_new=32)
    assert max(peaks) == 632 and all(rows == 1 or rows * columns <= 300 for _, rows, columns in forwards)


def test_continuous_batching_takes_fewer_steps_than_batches_with_a_long_tail():
    """One rank, 64 prompts, answers of 2 tokens but every 8th of 32, a budget of 16 rows: batches of 16 decoded
    to their end (before continuous batching) run 4 prefills + 4 x 31 decoding steps = 128 forwards; refilled slots
    run the long answers side by side: 45 forwards."""
    answers = [32 if i % 8 == 0 else 2 for i in range(64)]
    forwards, _, _, _ = _simulate([([10] * 64, answers)], budget=16 * (10 + 32), max_new=32)
    batches = sum(len(_simulate([([10] * 16, answers[b:b + 16])], budget=10**9, max_new=32)[0])
                  for b in range(0, 64, 16))
    assert (len(forwards), batches) == (45, 128)


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


def test_plan_step_agrees_rows_refills_and_widths():
    # (live, waiting, affordable, width of the next prompts, longest live row) per DP rank
    plan = plan_step([(3, 10, 6, 9, 20), (5, 0, 40, 0, 30)])
    assert plan.rows == 6 and plan.admit == (3, 0) and plan.batch == 3 and plan.width == 9 and plan.decode
    assert plan.columns == 30
    plan = plan_step([(0, 0, 512, 0, 0), (2, 0, 40, 0, 11)])  # the tail: nothing waits, the pool shrinks
    assert plan.rows == 2 and plan.admit == (0, 0) and plan.batch == 0
    plan = plan_step([(0, 4, 1, 900, 0), (6, 0, 8, 0, 12)])  # a prompt only affordable alone: rank 0 admits one
    assert plan.rows == 6 and plan.admit == (1, 0) and plan.width == 900


class _Counted:
    """The toy backend without its decoder (generation re-runs prompts), counting the shapes of its forwards."""

    def __init__(self, backend):
        self.layout, self.tokenizer, self.max_length, self.module = (backend.layout, backend.tokenizer,
                                                                     backend.max_length, backend.module)
        self._forward, self.shapes = backend.forward, []

    def forward(self, batch):
        self.shapes.append(tuple(batch.input_ids.shape))
        return self._forward(batch)


class _Peer(Agreement):
    """lockstep on one process beside a scripted second DP rank: `peer(step)` gives its numbers for each step."""

    def __init__(self, layout, peer):
        super().__init__(layout, lockstep=True)
        self.peer, self.steps = peer, 0

    def meet(self, unfinished=True, numbers=()):
        go = super().meet(unfinished, numbers)  # one process: no collective
        other = self.peer(self.steps)
        self.steps += 1
        self.numbers.append(list(other))
        return go or bool(other[0] or other[1])


@pytest.mark.parametrize("peer_kind", ["wide", "refilling"])
def test_lockstep_decoding_gives_the_same_generations(toy_backend, monkeypatch, peer_kind):
    """Beside a peer rank, this rank runs the agreed forwards on the KV cache and on the re-run path, and the
    results are the plain decode's (the re-run path, 2 rows at a time: refilled slots). "wide": the peer admits 4
    wider prompts at once and keeps them live for 2 steps (the peer's width, its rows as dead rows here, then the
    pool shrinking). "refilling": this rank affords 2 rows; the peer admits a prompt at every step (this rank's
    refill prefills: its own prompts as its rows finish, one-token fillers otherwise)."""
    import nano_eval.generate as generate

    engine = Engine(toy_backend, BatchingConfig(), progress=False)
    requests = [GreedyUntilRequest("t", i, 0, p, stop_sequence=["e"], generation_size=6)
                for i, p in enumerate(["The cat", "One two three four", "a", "Two", "Five six"])]
    dataset = engine.prepare_greedy(requests)
    rows = [dataset[i] for i in range(len(requests))]
    args = (engine.pad_id, engine.tokens.eos_ids, engine._vocab_shard)
    width = max(len(r.segments[0].context) for r in rows) + 3
    plans = []
    monkeypatch.setattr(generate, "plan_step", lambda numbers: plans.append(plan_step(numbers)) or plans[-1])

    def wide(step):  # (live, waiting, affordable, width, longest)
        return (0, 4, 512, width, 0) if step == 0 else (4, 0, 512, 0, width + step) if step <= 2 else (0, 0, 512, 0, 0)

    def refilling(step):
        return (0, 2, 512, 4, 0) if step == 0 else (1, 1, 512, 3, 4 + step) if step <= 12 else (0, 0, 512, 0, 0)

    peer, max_rows = (wide, None) if peer_kind == "wide" else (refilling, 2)

    plain_backend, lockstep_backend = _Counted(toy_backend), _Counted(toy_backend)
    embedded = []
    hook = toy_backend.model.get_input_embeddings().register_forward_hook(
        lambda m, a, out: embedded.append(tuple(a[0].shape)))
    try:
        with torch.no_grad():
            plain = greedy_decode(plain_backend, rows, *args, max_rows=2)
            plans.clear()
            stepped = greedy_decode(lockstep_backend, rows, *args, lockstep=True, max_rows=max_rows,
                                    agreement=_Peer(toy_backend.layout, peer))
            rerun_plans, plans[:], embedded[:] = list(plans), [], []
            cached = greedy_decode(toy_backend, rows, *args, lockstep=True, max_rows=max_rows,
                                   agreement=_Peer(toy_backend.layout, peer))
    finally:
        hook.remove()
    assert stepped == plain and cached == plain
    assert len({len(g.tokens) for g in plain.values()}) > 1  # rows finished at different steps
    # the re-run path: one forward a step, of the agreed rows and columns
    assert lockstep_backend.shapes == [(p.rows, p.columns) for p in rerun_plans]
    if peer_kind == "wide":
        assert rerun_plans[0].rows == 5 and rerun_plans[0].width == width  # the peer's width for our 5 prompts
    else:
        assert all(p.rows == 2 and p.batch >= 1 for p in rerun_plans[1:12])  # a refill prefill at every step
    # the KV cache: a decode step of the kept rows (when some rank has a live row), then the refill's prefill
    expected, rows_before = [], 0
    for p in plans:
        if p.decode:
            expected.append((min(rows_before, p.rows), 1))
        if p.batch:
            expected.append((p.batch, p.width))
        rows_before = p.rows
    assert embedded == expected
    if peer_kind == "wide":
        assert plans[-1].rows < plans[0].rows  # as rows finish and nothing waits, the pool shrinks
