"""`nano_eval sweep RUN_DIR --tasks SPECS --output-dir OUT [selection] [--watch ...] [--wandb-project P ...]`.

Takes every model and task option of `nano_eval/run.py` (see -h); under torchrun every rank evaluates each
checkpoint (data parallel) and rank 0 writes.
"""

from __future__ import annotations

import argparse
import os
import time

from nano_eval.sweep.runner import SweepOptions, SweepRunner


def build_parser() -> argparse.ArgumentParser:
    from nano_eval.run import build_parser as run_parser

    p = run_parser()
    p.prog, p.description = "nano_eval sweep", __doc__.splitlines()[0]
    p.add_argument("run_dir", nargs="?", help="training run directory holding the checkpoints (or --checkpoint)")
    g = p.add_argument_group("sweep: which checkpoints")
    g.add_argument("--every", type=int, default=None, help="only steps divisible by K")
    g.add_argument("--min-step", type=int, default=None)
    g.add_argument("--max-step", type=int, default=None)
    g.add_argument("--last", type=int, default=None, help="only the last N checkpoints (after the filters above)")
    g.add_argument("--tokens-per-step", type=int, default=None,
                   help="consumed tokens = step x N, for checkpoints whose metadata does not say")
    g = p.add_argument_group("sweep: waiting for checkpoints")
    g.add_argument("--watch", action="store_true", help="keep polling and evaluate new checkpoints as they appear")
    g.add_argument("--poll-s", type=float, default=30.0, help="seconds between looks at RUN_DIR (--watch)")
    g.add_argument("--until-step", type=int, default=None, help="stop once a checkpoint at or past this step is done")
    g.add_argument("--settle-s", type=float, default=5.0,
                   help="a checkpoint without a trainer marker must look unchanged this long before it is read")
    g.add_argument("--no-report", action="store_true", help="skip the PNG/HTML learning-curve report")
    g = p.add_argument_group("sweep: W&B")
    g.add_argument("--wandb-project", default=None, help="log into a new W&B run of this project")
    g.add_argument("--wandb-entity", default=None)
    g.add_argument("--wandb-run-id", default=None, help="resume this run (e.g. the training run) instead")
    g.add_argument("--wandb-run-name", default=None)
    g.add_argument("--wandb-mode", default=None, choices=["online", "offline", "disabled"])
    return p


def options_from_args(args: argparse.Namespace) -> SweepOptions:
    return SweepOptions(
        run_dir=args.run_dir, every=args.every, min_step=args.min_step, max_step=args.max_step, last=args.last,
        watch=args.watch, poll_s=args.poll_s, settle_s=args.settle_s, until_step=args.until_step,
        tokens_per_step=args.tokens_per_step, report=not args.no_report, wandb_project=args.wandb_project,
        wandb_entity=args.wandb_entity, wandb_run_id=args.wandb_run_id, wandb_run_name=args.wandb_run_name,
        wandb_mode=args.wandb_mode,
    )


def main(argv: list[str] | None = None) -> int:
    from nano_eval.run import init_distributed, run_command

    parser = build_parser()
    args = parser.parse_args(argv)
    args.run_dir = args.run_dir or args.checkpoint
    if not args.run_dir:
        parser.error("the run directory is needed: nano_eval sweep RUN_DIR --tasks ... (or --checkpoint RUN_DIR)")
    for name in ("every", "last", "poll_s"):
        if getattr(args, name) is not None and getattr(args, name) <= 0 and not (name == "last" and args.last == 0):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.demo or args.list_tasks:
        parser.error("--demo and --list-tasks belong to `nano_eval` itself, not to `nano_eval sweep`")

    def body() -> None:
        init_distributed(args.device, args.dist_timeout)
        start = time.perf_counter()
        summary = SweepRunner(args, options_from_args(args)).run()
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"\nsweep of {args.run_dir}: {len(summary.evaluated)} evaluated, {len(summary.reused)} reused, "
                  f"{len(summary.incomplete)} skipped as unfinished, in {time.perf_counter() - start:.1f}s; "
                  f"table: {os.path.join(args.output_dir, 'sweep_results.csv')}")

    return run_command(body, "sweep")
