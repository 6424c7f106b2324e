"""The command line: argv -> frozen configs, once, then the library. Nothing in nano_eval imports this package;
only the entry points do (`nano_eval` console script, `python -m nano_eval`, `python nano_eval/run.py`).

    nano_eval [eval] --checkpoint DIR --tasks SPECS ...   score one checkpoint (eval is the default subcommand)
    nano_eval sweep RUN_DIR --tasks SPECS ...            score every checkpoint of a training run
    nano_eval compare OUT_A OUT_B ...                    the sweeps of several runs on one plot per task
"""

from __future__ import annotations

import argparse
import sys

from nano_eval import __version__

SUBCOMMANDS = {
    "eval": "score one checkpoint (or the toy --demo) on tasks: results.json + details (the default subcommand)",
    "sweep": "score every checkpoint of a training run directory, resumably: table, learning curves, W&B",
    "compare": "draw several runs' sweeps on one plot per task and flag differences larger than their noise",
}


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` names (default: sys.argv[1:]) and return its exit code (--help, --version and bad
    arguments included: 0 and 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except SystemExit as e:  # argparse: --help, --version, errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


def _dispatch(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"], ["--version"]):
        return _top_level(argv)
    from nano_eval.cli import eval as eval_command
    from nano_eval.cli import sweep as sweep_command

    if argv[:1] == ["sweep"]:
        return sweep_command.main(argv[1:])
    if argv[:1] == ["compare"]:
        from nano_eval.cli import compare as compare_command

        return compare_command.main(argv[1:])
    argv = argv[1:] if argv[:1] == ["eval"] else argv
    if eval_command.names_a_run_dir(argv):  # `--checkpoint RUN_DIR`: a folder of checkpoints is swept
        return sweep_command.main(argv)
    return eval_command.main(argv)


def _top_level(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nano_eval", formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Score a model or its checkpoints on benchmark tasks, in the model's own "
                                            "TP/PP/DP layout.",
                                epilog="`nano_eval SUBCOMMAND --help` lists the options of a subcommand.\n"
                                       "Without a subcommand, nano_eval runs `eval`: nano_eval --demo, "
                                       "nano_eval --list-tasks, nano_eval --checkpoint DIR --tasks SPECS.")
    p.add_argument("--version", action="version", version=f"nano_eval {__version__}")
    sub = p.add_subparsers(title="subcommands", metavar="{eval,sweep,compare}")
    for name, text in SUBCOMMANDS.items():
        sub.add_parser(name, help=text)
    p.parse_args(argv)  # prints the help or the version and exits
    return 0
