"""`nano_eval eval` (the default subcommand): score one checkpoint on tasks, or the toy demo.

    torchrun --nproc_per_node=N nano_eval/run.py --checkpoint DIR --tasks SPECS --output-dir OUT

Every rank evaluates (data parallel); global rank 0 writes results.json (+ details/) at the end, atomically: a
failed run leaves no partial results, and a run into a folder that already holds results replaces them (details
included). An output folder that cannot be written is refused before any model loads (exit 2). `--checkpoint
RUN_DIR` on a folder of checkpoints runs `nano_eval sweep`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch.distributed as dist

from nano_eval.cli.options import Parser, add_model_options, add_run_options, add_task_options, eval_job
from nano_eval.cli.runtime import init_distributed, is_rank_zero, run_command
from nano_eval.tracking.files import check_output_paths

COMMAND = "nano_eval eval"
DEMO_TASKS = "demo|arithmetic|0,demo|arithmetic|3,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"


def build_parser() -> Parser:
    p = Parser(prog="nano_eval [eval]", command=COMMAND, description=__doc__.split("\n\n", 1)[0],
               epilog="  nano_eval --demo                      toy model, demo tasks, in seconds\n"
                      "  nano_eval --list-tasks | less        every task and superset\n"
                      "  nano_eval --checkpoint ckpt --tasks 'lighteval|hellaswag|0' --max-samples 500")
    p.add_argument("--checkpoint", help="transformers model folder or Hub id, nanotron checkpoint folder, Megatron "
                   "iter_XXXXXXX folder or run dir; a folder holding several checkpoints is swept")
    add_model_options(p)
    add_task_options(p)
    add_run_options(p)
    g = p.add_argument_group("other")
    g.add_argument("--list-tasks", action="store_true", help="print the available tasks and supersets, and exit")
    g.add_argument("--demo", action="store_true",
                   help="build a toy model (in --output-dir) and score it on the demo tasks")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.list_tasks and not args.demo and not (args.checkpoint and args.tasks):
        parser.error("both --checkpoint and --tasks are needed (or --demo, or --list-tasks)")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)

    def body() -> None:
        if args.list_tasks:
            from nano_eval.tasks import Registry

            from nano_eval.tasks.lm_eval_tasks import print_catalogue

            Registry(custom_tasks=args.custom_tasks).print_tasks()
            print_catalogue(args.lm_eval_include_path)
            return
        folders = (["details"] if not args.no_details else []) + (["toy_checkpoint"] if args.demo else [])
        check_output_paths(args.output_dir, folders=folders, files=["results.json"])  # before any model loads
        init_distributed(args.device, args.dist_timeout)
        checkpoint = build_demo_checkpoint(args.output_dir) if args.demo and not args.checkpoint else args.checkpoint
        job = eval_job(args, (args.tasks or DEMO_TASKS) if args.demo else args.tasks)
        start = time.perf_counter()
        results = evaluate(job, checkpoint)
        if is_rank_zero():
            print(results.table())
            print(f"\nwrote {Path(job.output_dir) / 'results.json'} in {time.perf_counter() - start:.1f}s")

    return run_command(body, "evaluation")


def evaluate(job, checkpoint: str):
    """Load the tasks (bad specs and missing data fail before the model loads), then score the checkpoint."""
    from nano_eval.job import evaluate_checkpoint
    from nano_eval.tasks import load_tasks

    from nano_eval.tracking.results import output_files

    tasks = load_tasks(job.tasks, custom_tasks=job.custom_tasks, data_dir=job.data_dir,
                       lm_eval_include_path=job.lm_eval_include_path)
    # every file this run will write (details of these tasks included), checked before the model loads
    check_output_paths(job.output_dir, files=output_files([spec.key for spec, _ in tasks], details=job.details))
    return evaluate_checkpoint(job, tasks, checkpoint, job.output_dir)


def build_demo_checkpoint(output_dir: str) -> str:
    """The demo's checkpoint: a toy Llama trained for a few seconds, built once by rank 0 in `output_dir`."""
    from nano_eval.toy import build_toy_checkpoint

    ckpt = Path(output_dir) / "toy_checkpoint"
    if is_rank_zero() and not (ckpt / "config.json").exists():
        build_toy_checkpoint(ckpt, train_steps=150)
    if dist.is_initialized():
        dist.barrier()  # the other ranks load what rank 0 built
    return str(ckpt)


def checkpoint_of(argv: list[str]) -> str | None:
    """The --checkpoint value of `argv`, whatever else it holds (sweep options included)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--checkpoint")
    return p.parse_known_args(argv)[0].checkpoint


def names_a_run_dir(argv: list[str]) -> bool:
    """`--checkpoint` names a folder that is not itself a checkpoint but holds checkpoints: sweep it."""
    from nano_eval.sweep.discovery import discover, is_checkpoint_dir

    path = checkpoint_of(argv)
    return bool(path) and Path(path).is_dir() and not is_checkpoint_dir(path) and bool(discover(path))
