"""`nano_eval compare OUT_A OUT_B ... --output-dir CMP`: the sweeps of several training runs on one plot per task,
their signal, noise and SNR across runs (Heineman et al. 2025), decision accuracy between a small-scale and a
target-scale group of runs, and every difference from the first run larger than the recorded standard errors
flagged (nano_eval.sweep.compare states how)."""

from __future__ import annotations

from nano_eval.cli.options import Parser, positive_float, positive_int
from nano_eval.cli.runtime import run_command

COMMAND = "nano_eval compare"


def _names(text: str | None) -> list[str] | None:
    return [n.strip() for n in text.split(",") if n.strip()] if text else None


def build_parser() -> Parser:
    p = Parser(prog=COMMAND, command=COMMAND, description=__doc__.split("\n\n", 1)[0])
    p.add_argument("sweeps", nargs="+", metavar="SWEEP_OUT", help="output folders of `nano_eval sweep` (the first "
                                                                    "is the baseline)")
    p.add_argument("--output-dir", default="nano_eval_compare",
                   help="where compare.csv, compare_signal.csv and index.html go (default: %(default)s)")
    p.add_argument("--labels", default=None, help="comma-separated run names, in the folders' order "
                                                  "(default: the folder names)")
    p.add_argument("--threshold", type=positive_float, default=2.0,
                   help="flag a difference larger than this many standard errors (default: %(default)s)")
    p.add_argument("--last-n", type=positive_int, default=5,
                   help="checkpoints at the end of each run behind signal (their mean) and noise (their relative "
                        "std) (default: %(default)s, as Heineman et al. at small scale)")
    p.add_argument("--small", default=None, metavar="A,B,...",
                   help="runs (labels) of the models at small scale, for decision accuracy (with --target); "
                        "signal and noise are then taken over these runs")
    p.add_argument("--target", default=None, metavar="C,D,...",
                   help="runs (labels) of the same models at target scale, in --small's order: model i is "
                        "small[i] and target[i]")
    return p


def main(argv: list[str]) -> int:
    """Exit codes: 0 compared (flagged differences are findings, not failures); 2 bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.sweeps) < 2:
        parser.error("compare needs two or more sweep output folders: nano_eval compare OUT_A OUT_B ...")

    def body() -> int:
        from nano_eval.local_files import printable
        from nano_eval.sweep.compare import write_comparison

        found, population = write_comparison(args.sweeps, _names(args.labels), args.output_dir, args.threshold,
                                             args.last_n, _names(args.small), _names(args.target))
        flagged = [d for d in found if d.flagged]
        out = printable(str(args.output_dir))
        print(f"{len(found)} comparisons, {len(flagged)} larger than {args.threshold:g} x stderr; "
              f"{out}/index.html, {out}/compare.csv, {out}/compare_signal.csv")
        for d in flagged:  # names from other runs' tables: printed escaped
            print(f"  {printable(d.task)} {printable(d.metric)}: {printable(d.run)} {d.value:.4f} vs "
                  f"{printable(d.baseline)} {d.baseline_value:.4f} at {d.x} {d.at:.4g} (difference "
                  f"{d.difference:+.4f}, z {d.z:+.1f})")
        print(f"signal and noise across runs (the last {args.last_n} checkpoints of each run, or all it has "
              "when fewer):")
        for p in population:
            accuracy = "" if p.decision_accuracy is None else \
                f", decision accuracy {p.decision_accuracy:.2f} ({p.pairs} pairs)"
            print(f"  {printable(p.task)} {printable(p.metric)}: signal {_fmt(p.signal)}, noise {_fmt(p.noise)}, "
                  f"SNR {_fmt(p.snr, '.3g')}{accuracy}")
        return 0

    return run_command(body, "compare")


def _fmt(v, fmt: str = ".4f") -> str:
    return "-" if v is None else format(v, fmt)
