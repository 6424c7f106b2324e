"""Option groups shared by `nano_eval eval` and `nano_eval sweep`, their checks, and argv -> frozen configs.

Every value is checked while parsing: a bad one ends the command with one `nano_eval: error: ...` line and exit
code 2, before anything is loaded.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from nano_eval.checkpoints.load import LoadOptions
from nano_eval.engine import BatchingConfig
from nano_eval.evaluator import EvalConfig
from nano_eval.job import EvalJob
from nano_eval.local_files import entry_kind, single_line, printable

TASK_FILE_SUFFIXES = (".txt", ".yaml", ".yml", ".json")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option with its default (unless its help already says it); descriptions and epilogs keep their line
    breaks."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        return help_text if "(default" in help_text else super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one `nano_eval: error:` line pointing at the command's --help."""

    def __init__(self, *args, command: str, **kwargs):
        super().__init__(*args, formatter_class=HelpFormatter, **kwargs)
        self.command = command

    def error(self, message: str):
        self.exit(2, f"nano_eval: error: {single_line(message)} (see `{self.command} --help`)\n")


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = _number(text, float)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text!r}")
    return value


def _number(text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, got {text!r}")


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def byte_size(text: str) -> int:
    """A number of bytes, with an optional K/M/G/T suffix (powers of 1024): `512M`, `64G`, `1T`."""
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = value[-1:] if value[-1:] in _SIZE_UNITS and value[-1:] else ""
    try:
        number = float(value[: len(value) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a size such as 512M, 64G or 1T, got {text!r}")
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive size, got {text!r}")
    return int(number * _SIZE_UNITS[unit])


def task_specs(text: str) -> str:
    """`--tasks`: specs, or a file of specs. A value that looks like a path must name an existing file."""
    looks_like_path = "|" not in text and ("/" in text or text.endswith(TASK_FILE_SUFFIXES))
    kind = entry_kind(Path(text).expanduser()) if looks_like_path else None
    if kind == "symlink":
        kind = entry_kind(os.path.realpath(Path(text).expanduser()))
    if looks_like_path and kind != "regular file":
        what = f"file not found: {printable(text)}" if kind is None else f"{printable(text)} is a {kind}, not a file"
        raise argparse.ArgumentTypeError(f"{what} (a task file holds one suite|task|k spec per "
                                         "line; or pass the specs themselves, comma-separated)")
    return text


def add_model_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--backend", default="transformers", choices=["transformers", "nanotron", "megatron"],
                   help="nanotron: nanotron's own model in --tp x --pp under torchrun (needs flash-attn); megatron: "
                        "megatron-core's GPTModel (dense or MoE) in --tp x --pp x --ep under torchrun; "
                        "transformers: any machine, one process per data-parallel replica")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree (--backend nanotron/megatron)")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel degree (--backend nanotron/megatron)")
    g.add_argument("--ep", type=positive_int, default=1, help="expert-parallel degree (--backend megatron)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or Hub id, for every checkpoint kind (default: the checkpoint's own; "
                        "nanotron: its config.yaml's; Megatron, torchtitan: required)")
    g.add_argument("--torchtitan-config", default=None, metavar="MODULE:CONFIG",
                   help="a torchtitan checkpoint's model: the --module and --config its run was started with (e.g. "
                        "llama3:llama3_8b; default: the nano_eval_torchtitan.json the training hook wrote)")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="where the model runs")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations (scores are always computed in fp32)")
    g.add_argument("--max-length", type=positive_int, default=None,
                   help="override the model's context length (default: the model's own)")
    g.add_argument("--add-bos-token", action=argparse.BooleanOptionalAction, default=None,
                   help="put BOS before every context (--no-add-bos-token: never); changes scores (default: the "
                        "tokenizer's own choice, as lm-evaluation-harness)")
    g.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own Python code to run")
    g.add_argument("--allow-symlinks-outside", action="store_true",
                   help="follow symlinks that leave the checkpoint or tokenizer folder (refused by default, naming "
                        "the link)")
    g.add_argument("--max-checkpoint-bytes", type=byte_size, default=None,
                   help="most memory a checkpoint's model may take (e.g. 64G); a checkpoint that declares more is "
                        "refused before anything is allocated (default: this machine's physical memory)")


def add_task_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tasks")
    g.add_argument("--tasks", type=task_specs, default=None,
                   help="comma-separated specs suite|task|num_fewshot, or a file with one per line; "
                        "lm_eval|<task, group or tag>|<k> runs an lm-evaluation-harness task")
    g.add_argument("--custom-tasks", default=None, help="Python file defining TASKS_TABLE = [TaskConfig(...)]")
    g.add_argument("--data-dir", default=None, help="offline data mirror: <dir>/<hf_repo>/<subset>/<split>")
    g.add_argument("--lm-eval-include-path", default=None,
                   help="folder of your own lm-evaluation-harness task YAMLs (its --include_path), for "
                        "lm_eval|<task>|<k> specs")
    g.add_argument("--lm-eval-bootstrap-iters", type=non_negative_int, default=None,
                   help="bootstrap resamples for the stderrs of lm_eval|... metrics lm-eval bootstraps (mcc, f1, "
                        "perplexity; bleu/chrf/ter at most 100), its bootstrap_iters: 100000 can take minutes per "
                        "metric; 0: no stderrs (default: lm-eval's, 100000)")
    g.add_argument("--max-samples", type=positive_int, default=None,
                   help="evaluate the first K documents of each task (lm-eval's --limit for lm_eval|... tasks; "
                        "default: all)")
    g.add_argument("--seed", type=int, default=0, help="few-shot sampling seed")
    g.add_argument("--use-chat-template", action="store_true",
                   help="build each context as a conversation with the tokenizer's chat template (instruct models; "
                        "off by default, for base models); changes scores")
    g.add_argument("--system-prompt", default=None,
                   help="text put first in every context (the system turn with --use-chat-template); changes scores")


def add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batching and output (scores never depend on batching)")
    g.add_argument("--batch-tokens", type=positive_int, default=BatchingConfig.max_batch_tokens,
                   help="padded tokens per forward")
    g.add_argument("--max-batch-size", type=positive_int, default=BatchingConfig.max_batch_size,
                   help="rows per forward")
    g.add_argument("--output-dir", default="nano_eval_results", help="where results.json and details/ go")
    g.add_argument("--no-details", action="store_true", help="skip the per-sample details files")
    g.add_argument("--dist-timeout", type=positive_float, default=600,
                   help="seconds a collective may wait for another rank before failing (torchrun)")


def load_options(args: argparse.Namespace) -> LoadOptions:
    return LoadOptions(backend=args.backend, tp=args.tp, pp=args.pp, ep=args.ep, tokenizer=args.tokenizer,
                       device=args.device, torchtitan_config=args.torchtitan_config,
                       dtype=args.dtype, max_length=args.max_length, trust_remote_code=args.trust_remote_code,
                       allow_symlinks_outside=args.allow_symlinks_outside,
                       max_checkpoint_bytes=args.max_checkpoint_bytes)


def eval_job(args: argparse.Namespace, tasks: str, *, progress: bool = True) -> EvalJob:
    """The frozen job the parsed arguments describe (`tasks` given apart: the demo fills it in)."""
    batching = BatchingConfig(max_batch_tokens=args.batch_tokens, max_batch_size=args.max_batch_size)
    return EvalJob(
        tasks=tasks, custom_tasks=args.custom_tasks, data_dir=args.data_dir,
        lm_eval_include_path=args.lm_eval_include_path, output_dir=args.output_dir,
        details=not args.no_details, load=load_options(args),
        eval=EvalConfig(max_samples=args.max_samples, seed=args.seed, add_bos_token=args.add_bos_token,
                        use_chat_template=args.use_chat_template, system_prompt=args.system_prompt,
                        lm_eval_bootstrap_iters=args.lm_eval_bootstrap_iters, batching=batching, progress=progress),
    )

