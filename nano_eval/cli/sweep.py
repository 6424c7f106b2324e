"""`nano_eval sweep RUN_DIR --tasks SPECS --output-dir OUT`: score every checkpoint of a training run, once each.

Resumable (a checkpoint already scored with the same settings is reused), `--watch` waits for new checkpoints;
writes <OUT>/<checkpoint>/results.json, a consolidated table, a learning-curve report and (optionally) W&B rows.
Under torchrun every rank evaluates each checkpoint (data parallel) and rank 0 writes.
"""

from __future__ import annotations

import argparse
import os
import time

from nano_eval.cli.options import (Parser, add_model_options, add_run_options, add_task_options, eval_job,
                                   non_negative_float, non_negative_int, positive_float, positive_int)
from nano_eval.cli.runtime import init_distributed, is_rank_zero, run_command
from nano_eval.errors import TasksFailedError
from nano_eval.sweep.launch import JOBS_DIR, LAUNCHERS, LaunchedSweep, LaunchOptions
from nano_eval.sweep.runner import SweepOptions, SweepRunner
from nano_eval.tracking.files import check_output_paths
from nano_eval.local_files import printable

COMMAND = "nano_eval sweep"


def build_parser() -> Parser:
    p = Parser(prog=COMMAND, command=COMMAND, description=__doc__.split("\n\n", 1)[0])
    p.add_argument("run_dir", nargs="?", help="training run directory holding the checkpoints")
    p.add_argument("--checkpoint", dest="checkpoint", default=None, help="the run directory, as an option")
    add_model_options(p)
    add_task_options(p)
    add_run_options(p)
    g = p.add_argument_group("which checkpoints")
    g.add_argument("--every", type=positive_int, default=None, help="only steps divisible by K")
    g.add_argument("--min-step", type=int, default=None, help="only steps >= this")
    g.add_argument("--max-step", type=int, default=None, help="only steps <= this")
    g.add_argument("--last", type=non_negative_int, default=None,
                   help="only the last N checkpoints (after the filters above)")
    g.add_argument("--tokens-per-step", type=positive_int, default=None,
                   help="consumed tokens = step x N, for checkpoints whose metadata does not say")
    g = p.add_argument_group("waiting for checkpoints")
    g.add_argument("--watch", action="store_true", help="keep polling and evaluate new checkpoints as they appear")
    g.add_argument("--poll-s", type=positive_float, default=30.0, help="seconds between looks at RUN_DIR (--watch)")
    g.add_argument("--until-step", type=int, default=None, help="stop once a checkpoint at or past this step is done")
    g.add_argument("--settle-s", type=non_negative_float, default=5.0,
                   help="a checkpoint without a trainer marker must look unchanged this long before it is read")
    g.add_argument("--no-report", action="store_true", help="skip the PNG/HTML learning-curve report")
    g.add_argument("--wait", action="store_true",
                   help="if another sweep is writing into --output-dir, wait until it ends (printing a line every "
                        "minute) instead of stopping with exit 2")
    g = p.add_argument_group("fan out as jobs (submitit; without --launcher the sweep runs in this process)")
    g.add_argument("--launcher", choices=LAUNCHERS, default=None,
                   help="submit one job per group of checkpoints: slurm (sbatch job arrays) or local (processes on "
                        "this machine); this process waits, merges and reports (default: none, the sweep runs here)")
    g.add_argument("--group-size", type=positive_int, default=1, help="checkpoints per job (default: %(default)s)")
    g.add_argument("--slurm-partition", default=None, help="Slurm partition (default: the cluster's default)")
    g.add_argument("--gpus-per-node", type=non_negative_int, default=1,
                   help="GPUs per node of a job, one rank each (default: %(default)s)")
    g.add_argument("--ranks-per-node", type=positive_int, default=None,
                   help="processes (ranks) per node of a job (default: one per GPU; with --gpus-per-node 0 "
                        "--device cpu, that many CPU ranks on gloo)")
    g.add_argument("--nodes", type=positive_int, default=1, help="nodes per job (default: %(default)s)")
    g.add_argument("--time", type=positive_int, default=60,
                   help="minutes per job before it is stopped (default: %(default)s)")
    g.add_argument("--account", default=None, help="Slurm account to charge (default: yours)")
    g.add_argument("--array-parallelism", type=positive_int, default=64,
                   help="Slurm jobs of one array running at once (default: %(default)s)")
    g = p.add_argument_group("W&B")
    g.add_argument("--wandb-project", default=None, help="log into a new W&B run of this project")
    g.add_argument("--wandb-entity", default=None, help="W&B entity (team) of the run")
    g.add_argument("--wandb-run-id", default=None, help="resume this run (e.g. the training run) instead")
    g.add_argument("--wandb-run-name", default=None, help="name of a new run")
    g.add_argument("--wandb-mode", default=None, choices=["online", "offline", "disabled"],
                   help="W&B mode (default: WANDB_MODE or W&B's own default)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.run_dir = args.run_dir or args.checkpoint
    if not args.run_dir:
        parser.error("the run directory is needed: nano_eval sweep RUN_DIR --tasks ... (or --checkpoint RUN_DIR)")
    if not args.tasks:
        parser.error("a sweep needs --tasks 'suite|task|k,...' (see `nano_eval --list-tasks`)")
    return args


def sweep_options(args: argparse.Namespace) -> SweepOptions:
    return SweepOptions(
        run_dir=args.run_dir, every=args.every, min_step=args.min_step, max_step=args.max_step, last=args.last,
        watch=args.watch, poll_s=args.poll_s, settle_s=args.settle_s, until_step=args.until_step,
        tokens_per_step=args.tokens_per_step, report=not args.no_report, wandb_project=args.wandb_project,
        wandb_entity=args.wandb_entity, wandb_run_id=args.wandb_run_id, wandb_run_name=args.wandb_run_name,
        wandb_mode=args.wandb_mode, wait=args.wait,
    )


def launch_options(args: argparse.Namespace) -> LaunchOptions:
    return LaunchOptions(launcher=args.launcher, group_size=args.group_size, partition=args.slurm_partition,
                         gpus_per_node=args.gpus_per_node, ranks_per_node=args.ranks_per_node, nodes=args.nodes,
                         time_min=args.time,
                         account=args.account, array_parallelism=args.array_parallelism,
                         dist_timeout_s=args.dist_timeout)


def check_sweep_output(args: argparse.Namespace) -> None:
    """Refuse an output folder the sweep could not write in, before any checkpoint loads (exit 2)."""
    from nano_eval.sweep.launch import RUNNING_NAME
    from nano_eval.sweep.lock import LOCK_NAME, OWNER_NAME, SETTINGS_NAME
    from nano_eval.sweep.report import HTML_NAME, REPORT_DIR
    from nano_eval.sweep.table import CSV_NAME, PARQUET_NAME, SIGNAL_CSV_NAME, SIGNAL_PARQUET_NAME
    from nano_eval.sweep.worker import CLAIMS_DIR, STATUS_DIR

    folders = ([] if args.no_report else [REPORT_DIR]) + (
        [JOBS_DIR, f"{JOBS_DIR}/{CLAIMS_DIR}", f"{JOBS_DIR}/{STATUS_DIR}"] if args.launcher else [])
    files = [CSV_NAME, PARQUET_NAME, SIGNAL_CSV_NAME, SIGNAL_PARQUET_NAME, SETTINGS_NAME, LOCK_NAME, OWNER_NAME,
             *([] if args.no_report else [f"{REPORT_DIR}/{HTML_NAME}"]),
             *([f"{JOBS_DIR}/{RUNNING_NAME}"] if args.launcher else [])]
    check_output_paths(args.output_dir, folders=folders, files=files)


def print_results(args: argparse.Namespace, summary, seconds: float) -> None:
    """Rank 0, at the end: the results table (one line per task x metric, the last checkpoints as columns), the
    counts, and where the table, the report and the job logs are."""
    from nano_eval.sweep.report import HTML_NAME, REPORT_DIR
    from nano_eval.local_files import printable
    from nano_eval.sweep.table import CSV_NAME, read_table, text_table

    table = os.path.join(args.output_dir, CSV_NAME)
    if os.path.isfile(table) and not os.path.islink(table):
        print("\n" + "\n".join(printable(line) for line in text_table(read_table(args.output_dir)).splitlines()))
    report = os.path.join(args.output_dir, REPORT_DIR, HTML_NAME)
    print(f"\nsweep of {printable(str(args.run_dir))}: {len(summary.evaluated)} evaluated, "
          f"{len(summary.reused)} reused, "
          f"{len(summary.incomplete)} skipped as unfinished, {len(summary.failed)} failed, in {seconds:.1f}s\n"
          f"table: {table}" + (f"\nreport: {report}" if not args.no_report and os.path.isfile(report) else "")
          + (f"\njob logs: {os.path.join(args.output_dir, JOBS_DIR)}" if args.launcher else ""))


def main(argv: list[str]) -> int:
    """Exit codes: 0 every checkpoint done; 1 some checkpoints failed (recorded, the others done); 2 bad input;
    128 + signal when SIGTERM / SIGINT stopped it after the checkpoint in progress (143 / 130)."""
    args = parse(argv)

    def body() -> int:
        check_sweep_output(args)
        init_distributed(args.device, args.dist_timeout)
        start = time.perf_counter()
        job, options = eval_job(args, args.tasks), sweep_options(args)
        if args.launcher:
            summary = LaunchedSweep(job, options, launch_options(args)).run()
        else:
            summary = SweepRunner(job, options).run()
        table = os.path.join(args.output_dir, "sweep_results.csv")
        if is_rank_zero():
            print_results(args, summary, time.perf_counter() - start)
        if summary.signal is not None:
            return 128 + int(summary.signal)
        if summary.failed:
            listed = "; ".join(f"{name} (step {step}): {why}" for step, (name, why) in sorted(summary.failed.items()))
            raise TasksFailedError(f"{len(summary.failed)} checkpoint(s) failed and were skipped: {listed}. They are "
                                   f"listed in {table} (column error); rerun the same command once they are fixed "
                                   "(finished checkpoints are reused).")
        return 0

    return run_command(body, "sweep")
