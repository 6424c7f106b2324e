"""Evaluate a checkpoint: `torchrun --nproc_per_node=N nano_eval/run.py --checkpoint DIR --tasks SPECS --output-dir OUT`.

`python nano_eval/run.py --demo` builds a toy model in seconds and scores it on the built-in demo suite.
Files are written by global rank 0 only, at the end, atomically: a failed run leaves no partial results.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import traceback
from datetime import datetime, timedelta, timezone
from pathlib import Path

import torch
import torch.distributed as dist

from nano_eval import __version__
from nano_eval.engine import BatchingConfig
from nano_eval.errors import NanoEvalError
from nano_eval.evaluator import EvalConfig, EvalResults, Evaluator
from nano_eval.parallel import ParallelLayout
from nano_eval.tracking.files import SCHEMA_VERSION, details_file_name, write_json, write_jsonl

DEMO_TASKS = "demo|arithmetic|0,demo|arithmetic|3,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nano_eval", description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="transformers model folder, Hub id, nanotron Llama checkpoint folder, Megatron "
                   "iter_XXXXXXX folder, or a run folder holding several checkpoints (swept)")
    p.add_argument("--backend", default="transformers", choices=["transformers", "nanotron"],
                   help="nanotron: build nanotron's own model in --tp x --pp (GPU + flash-attn); transformers: any machine")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (--backend nanotron)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (--backend nanotron)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer for a nanotron (default: its config.yaml's) or Megatron (required) checkpoint")
    p.add_argument("--tasks", help="comma-separated specs suite|task|num_fewshot, or a file with one per line")
    p.add_argument("--output-dir", default="nano_eval_results", help="where results.json and details/ go")
    p.add_argument("--max-samples", type=int, default=None, help="evaluate the first K documents of each task")
    p.add_argument("--custom-tasks", default=None, help="Python file defining TASKS_TABLE = [TaskConfig(...)]")
    p.add_argument("--data-dir", default=None, help="offline data mirror: <dir>/<hf_repo>/<subset>/<split>")
    p.add_argument("--seed", type=int, default=0, help="few-shot sampling seed")
    p.add_argument("--batch-tokens", type=int, default=BatchingConfig.max_batch_tokens, help="padded tokens per forward")
    p.add_argument("--max-batch-size", type=int, default=BatchingConfig.max_batch_size)
    p.add_argument("--max-length", type=int, default=None, help="override the model's context length")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own Python code to run")
    p.add_argument("--no-details", action="store_true", help="skip the per-sample details files")
    p.add_argument("--dist-timeout", type=float, default=600, help="seconds a collective may wait before failing")
    p.add_argument("--list-tasks", action="store_true", help="print the available tasks and exit")
    p.add_argument("--demo", action="store_true", help="build a toy model and score it on the demo suite")
    return p


def init_distributed(device: str, timeout_s: float) -> None:
    """Join the torchrun process group if launched by torchrun (gloo on CPU, nccl on GPU).

    The timeout bounds how long a rank waits in a collective for a peer that died (launchers other than torchrun
    do not kill the surviving ranks for us)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def checkpoint_identity(path: str) -> dict:
    """A cheap fingerprint of a checkpoint folder: file names, sizes and the first MiB of each weight file."""
    p = Path(path)
    if not p.is_dir():
        return {"path": path}
    digest = hashlib.sha256()
    for f in sorted(x for x in p.iterdir() if x.is_file()):
        digest.update(f"{f.name}:{f.stat().st_size}".encode())
        if f.suffix in (".safetensors", ".bin", ".json"):
            with f.open("rb") as fh:
                digest.update(fh.read(1 << 20))
    return {"path": str(p.resolve()), "fingerprint": digest.hexdigest()[:16]}


def results_document(args, results: EvalResults, layout: ParallelLayout, task_versions: dict) -> dict:
    return {
        "schema_version": SCHEMA_VERSION,
        "nano_eval_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "checkpoint": checkpoint_identity(args.checkpoint),
        "layout": layout.describe(),
        "config": {
            "tasks": args.tasks,
            "max_samples": args.max_samples,
            "seed": args.seed,
            "batch_tokens": args.batch_tokens,
            "max_batch_size": args.max_batch_size,
            "dtype": args.dtype,
            "max_length": args.max_length,
        },
        "task_versions": task_versions,
        "results": {k: tr.metrics for k, tr in results.tasks.items()},
        "num_docs": {k: tr.num_docs for k, tr in results.tasks.items()},
        "skipped_docs": {k: tr.skipped_docs for k, tr in results.tasks.items()},
        "truncated_requests": {k: tr.truncated_requests for k, tr in results.tasks.items()},
        "timings": results.timings,
    }


def write_outputs(out_dir: Path, document: dict, results: EvalResults, details: bool) -> None:
    """Details first, results.json last: results.json present means the run finished."""
    if details:
        for key, tr in results.tasks.items():
            write_jsonl(out_dir / "details" / details_file_name(key), tr.details)
    write_json(out_dir / "results.json", document)


def prepare_demo(args) -> None:
    """Fill in the demo's checkpoint (a toy Llama trained for a few seconds) and tasks."""
    from nano_eval.toy import build_toy_checkpoint

    ckpt = Path(args.output_dir) / "toy_checkpoint"
    if int(os.environ.get("RANK", "0")) == 0 and not (ckpt / "config.json").exists():
        build_toy_checkpoint(ckpt, train_steps=150)
    if dist.is_initialized():
        dist.barrier()  # the other ranks load what rank 0 built
    args.checkpoint, args.tasks = args.checkpoint or str(ckpt), args.tasks or DEMO_TASKS


def build_backend(args):
    """The model behind the evaluation: nanotron's own model class (--backend nanotron), else a transformers model
    from a transformers folder / Hub id or from a nanotron Llama checkpoint (converted)."""
    from nano_eval.models.nanotron_checkpoint import is_nanotron_checkpoint, load_as_transformers, load_native
    from nano_eval.models.transformers_model import TransformersModel

    if args.backend == "nanotron":
        if not is_nanotron_checkpoint(args.checkpoint):
            raise NanoEvalError(f"--backend nanotron needs a nanotron checkpoint (config.yaml + model/): {args.checkpoint}")
        return load_native(args.checkpoint, args.tokenizer, tp=args.tp, pp=args.pp, dtype=args.dtype,
                           max_length=args.max_length)
    if is_nanotron_checkpoint(args.checkpoint):
        return load_as_transformers(args.checkpoint, args.tokenizer, device=args.device, dtype=args.dtype,
                                    max_length=args.max_length)
    from nano_eval.models.megatron_checkpoint import is_megatron_checkpoint
    from nano_eval.models.megatron_checkpoint import load_as_transformers as load_megatron

    if is_megatron_checkpoint(args.checkpoint):
        return load_megatron(args.checkpoint, args.tokenizer, device=args.device, dtype=args.dtype,
                             max_length=args.max_length)
    return TransformersModel.from_pretrained(
        args.checkpoint, device=args.device, dtype=args.dtype, max_length=args.max_length,
        trust_remote_code=args.trust_remote_code,
    )


def evaluate(args) -> EvalResults:
    from nano_eval.tasks import Registry, load_datasets

    if not args.checkpoint or not args.tasks:
        raise NanoEvalError("both --checkpoint and --tasks are needed (or --demo). Fix: see `nano_eval/run.py -h`.")
    registry = Registry(custom_tasks=args.custom_tasks)
    specs = registry.parse_specs(args.tasks)
    tasks = registry.get_task_dict(specs, data_dir=args.data_dir)
    load_datasets(tasks, processes=min(8, len(tasks)))
    backend = build_backend(args)
    batching = BatchingConfig(max_batch_tokens=args.batch_tokens, max_batch_size=args.max_batch_size)
    config = EvalConfig(max_samples=args.max_samples, seed=args.seed, batching=batching)
    evaluator = Evaluator(backend, [(s, tasks[s.full_name]) for s in specs], config)
    results = evaluator.evaluate()
    if backend.layout.is_main:
        versions = {s.key: tasks[s.full_name].version for s in specs}
        write_outputs(Path(args.output_dir), results_document(args, results, backend.layout, versions), results,
                      details=not args.no_details)
    return results


def is_run_dir(path: str | None) -> bool:
    """A folder that is not itself a checkpoint but holds checkpoints: `--checkpoint RUN_DIR` sweeps it."""
    from nano_eval.sweep.discovery import discover, is_checkpoint_dir

    return bool(path) and Path(path).is_dir() and not is_checkpoint_dir(path) and bool(discover(path))


def run_command(body, what: str) -> int:
    """Run a command's body on this rank and turn failures into exit codes every launcher understands.

    NanoEvalError (bad input): one `nano_eval: error:` line, exit 2. Anything else: the traceback, exit 1 at
    once, so torchrun stops the other ranks instead of leaving them waiting in a collective."""
    rank = int(os.environ.get("RANK", "0"))
    prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    try:
        body()
    except NanoEvalError as e:
        print(f"nano_eval: error: {prefix}{e}", file=sys.stderr)
        return 2
    except Exception as e:
        traceback.print_exc()
        print(f"nano_eval: error: {prefix}{what} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if dist.is_initialized():
        # Leave together: a rank that tears its gloo group down while rank 0 still writes (a sweep's report)
        # was seen to abort ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sweep"] or is_run_dir(build_parser().parse_known_args(argv)[0].checkpoint):
        from nano_eval.sweep.cli import main as sweep_main

        return sweep_main(argv[1:] if argv[:1] == ["sweep"] else argv)
    args = build_parser().parse_args(argv)

    def body() -> None:
        if args.list_tasks:
            from nano_eval.tasks import Registry

            Registry(custom_tasks=args.custom_tasks).print_tasks()
            return
        init_distributed(args.device, args.dist_timeout)
        if args.demo:
            prepare_demo(args)
        start = time.perf_counter()
        results = evaluate(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print(results.table())
            print(f"\nwrote {Path(args.output_dir) / 'results.json'} in {time.perf_counter() - start:.1f}s")

    return run_command(body, "evaluation")


if __name__ == "__main__":
    sys.exit(main())
