"""Train the toy Llama on arithmetic for a minute or two on CPU, evaluating it every N steps with EvalHook.

    python examples/train_with_eval_hook.py
    torchrun --nproc_per_node=2 examples/train_with_eval_hook.py      # data parallel (DDP over gloo)

The script plays the trainer: it opens its own W&B run (offline, into --output-dir) and logs the training loss;
the hook logs the eval metrics into that same run with the training step as x-axis, writes
<output-dir>/eval_results.jsonl (one line per evaluation) and <output-dir>/step_<N>/results.json, and at the
end this script prints the metrics over the steps from the JSONL file. `wandb sync <output-dir>/wandb/offline-run-*`
uploads the run later if you want to see the charts.

Like a real trainer it also saves checkpoints, every --save-every steps, as transformers folders
<output-dir>/checkpoints/step_<N>/ (with trainer_state.json holding the consumed tokens). Each one appears
complete or not at all (written beside, then renamed), so a sweep can watch the folder while training runs:
`bash examples/sweep_run_dir.sh <output-dir>/checkpoints` scores them all afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from nano_eval.toy import arithmetic_line, build_model, build_tokenizer  # noqa: E402
from nano_eval.tracking.jsonl import read_jsonl  # noqa: E402
from nano_eval.training.config import EvalHookConfig  # noqa: E402
from nano_eval.training.hook import JSONL_NAME, EvalHook  # noqa: E402

TASKS = "demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"
SHOWN = [("demo|arithmetic|0", "acc"), ("demo|arithmetic|0", "acc_norm_pmi"), ("demo|arithmetic_gen|3", "exact_match"),
         ("demo|arithmetic_ppl|0", "bits_per_byte")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--eval-every", type=int, default=150)
    p.add_argument("--max-samples", type=int, default=100, help="documents per task and evaluation")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--output-dir", default="train_with_eval_hook_out")
    p.add_argument("--save-every", type=int, default=300, help="save a checkpoint every N steps (0: never)")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    p.add_argument("--time-budget-s", type=float, default=None, help="soft limit per evaluation (between tasks)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (a toy model: 1 is fastest)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    out = Path(args.output_dir)

    # The trainer's own setup: identical replicas on every rank (fixed seed), different data per rank.
    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    model = build_model(len(tokenizer), seed=0)
    model.train()
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = random.Random(1000 + rank)

    run = None
    if rank == 0 and args.wandb_mode != "disabled":
        try:
            import wandb

            out.mkdir(parents=True, exist_ok=True)
            run = wandb.init(project="nano_eval_example", dir=str(out.resolve()), mode=args.wandb_mode,
                             config=vars(args))
            run.define_metric("train/loss", step_metric="train/step")
        except Exception as e:  # the example still runs without W&B
            print(f"W&B unavailable ({type(e).__name__}: {e}); continuing without it", file=sys.stderr)

    # Built once on every rank: tasks loaded and tokenised here. It finds the W&B run opened above (rank 0).
    hook = EvalHook.for_transformers(
        EvalHookConfig(tasks=TASKS, every_n_steps=args.eval_every, also_at_steps=(0,), max_samples=args.max_samples,
                       output_dir=out, time_budget_s=args.time_budget_s),
        model, tokenizer,
    )

    consumed, start = 0, time.perf_counter()
    hook.maybe_evaluate(0, consumed_tokens=0)  # the untrained baseline
    for step in range(1, args.steps + 1):
        lines = [
            "\n\n".join(arithmetic_line(rng.randrange(10), rng.randrange(10)) for _ in range(rng.randint(1, 12)))
            for _ in range(args.batch_size)
        ]
        enc = tokenizer(lines, return_tensors="pt", padding=True)
        loss = model(**enc, labels=enc.input_ids.masked_fill(enc.attention_mask == 0, -100)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        tokens = enc.attention_mask.sum()
        if world > 1:
            dist.all_reduce(tokens)
        consumed += int(tokens)
        if run is not None and step % 10 == 0:
            run.log({"train/loss": loss.item(), "train/step": step, "train/consumed_tokens": consumed})
        if rank == 0 and args.save_every and step % args.save_every == 0:
            save_checkpoint(getattr(model, "module", model), tokenizer, out / "checkpoints", step, consumed)
        results = hook.maybe_evaluate(step, consumed_tokens=consumed)  # every rank calls it; None when not due
        if results is not None and rank == 0:
            print(f"step {step}: loss {loss.item():.3f}, eval {results.time_s:.1f}s "
                  f"({100 * hook.time_share:.0f}% of wall time so far)", flush=True)
    hook.close()
    if run is not None:
        run.finish()

    if rank == 0:
        rows = read_jsonl(out / JSONL_NAME)
        header = ["step", "tokens"] + [f"{t.split('|')[1]}/{m}" for t, m in SHOWN] + ["eval_s"]
        print(f"\ntrained {args.steps} steps on {world} process(es) in {time.perf_counter() - start:.0f}s; "
              f"metrics from {out / JSONL_NAME}:")
        print("  ".join(f"{h:>26}" if "/" in h else f"{h:>7}" for h in header))
        for row in rows:
            if "failed" in row:  # a fail-soft failure: the step's row says why
                print(f"{row['step']:>7}  failed: {row['failed']}")
                continue
            cells = [f"{row['step']:>7}", f"{row['consumed_tokens']:>7}"]
            for task, metric in SHOWN:
                value = row["results"].get(task, {}).get(metric)
                cells.append(f"{value:>26.4f}" if value is not None else f"{'skipped':>26}")
            print("  ".join(cells + [f"{row['time_s']:>7.1f}"]))
    if world > 1:
        dist.destroy_process_group()


def save_checkpoint(model, tokenizer, run_dir: Path, step: int, consumed_tokens: int) -> Path:
    """Write `run_dir/step_<step>/` as a transformers folder, atomically: built in a hidden sibling, then renamed."""
    final = run_dir / f"step_{step}"
    staging = run_dir.parent / f".staging_step_{step}"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    (staging / "trainer_state.json").write_text(json.dumps({"global_step": step, "num_input_tokens_seen": consumed_tokens}))
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final


if __name__ == "__main__":
    main()
