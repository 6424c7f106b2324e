"""`nano_eval compare OUT_A OUT_B ... --output-dir CMP`: the sweeps of several training runs on one plot per task,
against consumed tokens, with every difference from the first run that is larger than the runs' noise flagged
(nano_eval.sweep.compare states how)."""

from __future__ import annotations

from nano_eval.cli.options import Parser, positive_float
from nano_eval.cli.runtime import run_command

COMMAND = "nano_eval compare"


def build_parser() -> Parser:
    p = Parser(prog=COMMAND, command=COMMAND, description=__doc__.split("\n\n", 1)[0])
    p.add_argument("sweeps", nargs="+", metavar="SWEEP_OUT", help="output folders of `nano_eval sweep` (the first "
                                                                    "is the baseline)")
    p.add_argument("--output-dir", default="nano_eval_compare",
                   help="where compare.csv and index.html go (default: %(default)s)")
    p.add_argument("--labels", default=None, help="comma-separated run names, in the folders' order "
                                                  "(default: the folder names)")
    p.add_argument("--threshold", type=positive_float, default=2.0,
                   help="flag a difference larger than this many noise units (default: %(default)s)")
    return p


def main(argv: list[str]) -> int:
    """Exit codes: 0 compared (flagged differences are findings, not failures); 2 bad input."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if len(args.sweeps) < 2:
        parser.error("compare needs two or more sweep output folders: nano_eval compare OUT_A OUT_B ...")

    def body() -> int:
        from nano_eval.sweep.compare import write_comparison

        labels = args.labels.split(",") if args.labels else None
        found = write_comparison(args.sweeps, labels, args.output_dir, args.threshold)
        flagged = [d for d in found if d.flagged]
        print(f"{len(found)} comparisons, {len(flagged)} larger than {args.threshold:g} x noise; "
              f"{args.output_dir}/index.html, {args.output_dir}/compare.csv")
        for d in flagged:
            print(f"  {d.task} {d.metric}: {d.run} {d.value:.4f} vs {d.baseline} {d.baseline_value:.4f} at "
                  f"{d.x} {d.at:.4g} (difference {d.difference:+.4f}, z {d.z:+.1f})")
        return 0

    return run_command(body, "compare")
