"""Compare the sweeps of several training runs: `nano_eval compare OUT_A OUT_B ... --output-dir CMP`.

Reads each sweep's `sweep_results.csv` and, for every task x metric:

1. Signal, noise and SNR across the runs, and decision accuracy between a small-scale and a target-scale group of
   runs, as Heineman et al. (2025, arXiv 2508.13144) define them (formulas: nano_eval.sweep.snr, part 1):

       signal = max_{j,k} |m_j - m_k| / |mean(m)|,   m_j = mean of run j's last n checkpoints, j over the
                                                      --small runs when given, else over all runs
       noise  = mean over runs of std(last n) / |mean(last n)|     (n = --last-n, default 5)
       SNR    = signal / noise
       decision accuracy = share of pairs (i, j) of models ordered alike at small and at target scale
                           (--small A,B,C --target D,E,F: model i is run small[i] at small scale and target[i] at
                           target scale; final scores)

2. Each run against the first (the baseline), where both have been: at x* = the smaller of the two runs' last
   consumed-token counts (steps when a run's tokens are unknown), each run's value is its recorded value at x*
   when it has a checkpoint there, else the linear interpolation in ln x between its two checkpoints around x*
   (never a fitted or extrapolated value: it stays within the run's observed values, so accuracies and
   probabilities stay in [0, 1]); its standard error is the metric's recorded stderr there (interpolated alike).

       difference = value_run(x*) - value_baseline(x*)
       z          = difference / sqrt(se_run^2 + se_baseline^2)     flagged when |z| > threshold (default 2)

   Without a recorded stderr in either run z is empty and nothing is flagged.

Writes `<CMP>/compare.csv` (one row per task x metric x run against the baseline), `<CMP>/compare_signal.csv`
(one row per task x metric: signal, noise, SNR, decision accuracy) and `<CMP>/index.html` (the tables and, with
matplotlib, one plot per task x metric: plots.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from nano_eval.errors import NanoEvalError
from nano_eval.local_files import printable
from nano_eval.sweep import plots
from nano_eval.sweep.plots import html_text
from nano_eval.sweep.metric_kinds import bounded
from nano_eval.sweep.snr import LAST_N, Curve, PopulationStats, population_stats, table_curves
from nano_eval.sweep.table import CSV_NAME, csv_text, read_table
from nano_eval.tracking.files import atomic_write_text

COLUMNS = ("task", "metric", "run", "baseline", "x", "at", "value", "baseline_value", "difference", "noise", "z",
           "flagged")
SIGNAL_COLUMNS = ("task", "metric", "runs", "last_n", "signal", "noise", "snr", "decision_accuracy", "pairs")
CSV_OUT, SIGNAL_CSV_OUT, HTML_OUT = "compare.csv", "compare_signal.csv", "index.html"
MAX_PLOTS = 24  # plots on the page (one per task x metric, the largest differences first)


@dataclass(frozen=True)
class Difference:
    task: str
    metric: str
    run: str
    baseline: str
    x: str  # "consumed_tokens" | "step"
    at: float  # x*: the last x both runs reached
    value: float  # the run's value at x* (observed, or interpolated between observed checkpoints)
    baseline_value: float
    difference: float
    noise: float | None  # sqrt(se_run^2 + se_baseline^2) from the recorded stderrs
    z: float | None
    flagged: bool


def load_curves(out_dir: Path) -> dict[tuple[str, str], Curve]:
    """{(task, metric): curve} of one sweep output folder."""
    if not (Path(out_dir) / CSV_NAME).exists():
        raise NanoEvalError(f"{printable(str(out_dir))} holds no {CSV_NAME}. Fix: pass the --output-dir of a "
                            "`nano_eval sweep`.")
    return table_curves(read_table(out_dir))


def interpolate(points: list[tuple[float, float, float | None]], at: float) -> tuple[float, float | None] | None:
    """(value, stderr) of a curve at x = `at`: points are (x, value, stderr or None) in x order. A checkpoint at
    `at` gives its own; between two checkpoints both are interpolated linearly in ln x (in x when the lower x is
    0); None outside the curve (nothing is extrapolated)."""
    for x, y, e in points:
        if x == at:
            return y, e
    for (x0, y0, e0), (x1, y1, e1) in zip(points, points[1:]):
        if x0 < at < x1:
            w = (math.log(at) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x0 > 0 else (at - x0) / (x1 - x0)
            return y0 + w * (y1 - y0), (e0 + w * (e1 - e0) if e0 is not None and e1 is not None else None)
    return None


def value_at(curve: Curve, at: float, use_tokens: bool) -> tuple[float, float | None] | None:
    """(value, standard error) of a curve ((step, tokens, value, stderr) in step order) at x = `at` (tokens when
    `use_tokens`, else steps), from interpolate(): always within the values the run recorded; None outside it."""
    return interpolate([(float(t if use_tokens else s), v, e) for s, t, v, e in curve], at)


def differences(runs: dict[str, dict[tuple[str, str], Curve]], threshold: float = 2.0) -> list[Difference]:
    """Every run against the first (`runs`: name -> its curves, the baseline first), per shared task x metric:
    flagged first, then by |z|."""
    names = list(runs)
    base_name, out = names[0], []
    for key, base in runs[base_name].items():
        for name in names[1:]:
            other = runs[name].get(key)
            if not other:
                continue
            use_tokens = all(t for _, t, _, _ in base + other)
            at = min(float(c[-1][1] if use_tokens else c[-1][0]) for c in (base, other))
            va, vb = value_at(base, at, use_tokens), value_at(other, at, use_tokens)
            if va is None or vb is None:
                continue  # the runs do not overlap
            noise = math.sqrt(va[1] ** 2 + vb[1] ** 2) if va[1] is not None and vb[1] is not None else None
            z = (vb[0] - va[0]) / noise if noise else None
            out.append(Difference(*key, name, base_name, "consumed_tokens" if use_tokens else "step", at, vb[0],
                                  va[0], vb[0] - va[0], noise, z, z is not None and abs(z) > threshold))
    return sorted(out, key=lambda d: (not d.flagged, -abs(d.z or 0)))


def signal_table(runs: dict[str, dict[tuple[str, str], Curve]], last_n: int = LAST_N,
                 small: list[str] | None = None, target: list[str] | None = None) -> list[PopulationStats]:
    """snr.population_stats of every task x metric that two or more runs have, in the runs' order."""
    keys = list(dict.fromkeys(k for c in runs.values() for k in c))
    out = []
    for key in keys:
        curves = {name: c[key] for name, c in runs.items() if c.get(key)}
        if len(curves) >= 2:
            out.append(population_stats(*key, curves, last_n, small, target))
    return out


def check_groups(labels: list[str], small: list[str] | None, target: list[str] | None) -> None:
    """Refuse --small / --target that are not two equally long lists (2 or more) of the runs' labels."""
    if not small and not target:
        return
    if not small or not target or len(small) != len(target) or len(small) < 2:
        raise NanoEvalError(f"--small and --target need the same number (2 or more) of runs, got {small} and "
                            f"{target}. Fix: --small a,b --target c,d (model i: small[i] and target[i]).")
    unknown = [n for n in small + target if n not in labels]
    if unknown:
        raise NanoEvalError(f"--small / --target name runs that are not compared: {unknown}; the runs are "
                            f"{labels}. Fix: use the --labels (or folder names) of the sweeps given.")


def write_comparison(out_dirs: list[str], labels: list[str] | None, dest: str, threshold: float = 2.0,
                     last_n: int = LAST_N, small: list[str] | None = None, target: list[str] | None = None
                     ) -> tuple[list[Difference], list[PopulationStats]]:
    """Compare the sweeps in `out_dirs` (first = baseline); write compare.csv, compare_signal.csv and index.html
    into `dest`; returns (the differences, the signal table)."""
    labels = labels or [Path(d).resolve().name for d in out_dirs]
    if len(labels) != len(out_dirs) or len(set(labels)) != len(labels):
        raise NanoEvalError(f"--labels needs one distinct name per sweep folder ({len(out_dirs)}), got {labels}. "
                            "Fix: --labels a,b,... in the folders' order.")
    check_groups(labels, small, target)
    runs = {label: load_curves(Path(d)) for label, d in zip(labels, out_dirs)}
    found = differences(runs, threshold)
    population = signal_table(runs, last_n, small, target)
    atomic_write_text(Path(dest) / CSV_OUT, csv_text(COLUMNS, [asdict(d) for d in found]))
    atomic_write_text(Path(dest) / SIGNAL_CSV_OUT, csv_text(SIGNAL_COLUMNS, [asdict(p) for p in population]))
    atomic_write_text(Path(dest) / HTML_OUT, _page(runs, found, population, threshold, last_n))
    return found, population


def _figure(key: tuple[str, str], runs: dict[str, dict[tuple[str, str], Curve]]) -> str:
    """One <img>: every run's curve of `key` against consumed tokens (log scale; steps when unknown)."""
    curves = {name: c[key] for name, c in runs.items() if key in c}
    use_tokens = all(t for c in curves.values() for _, t, _, _ in c)
    series = {name: [(t if use_tokens else s, v, e) for s, t, v, e in c] for name, c in curves.items()}
    png = plots.curves_png(series, f"{key[0]}  {key[1]}", "consumed tokens" if use_tokens else "training step",
                           key[1], log_x=use_tokens, size=(5.5, 3.2), unit_interval=bounded(key[1]))
    return plots.img_tag(png, f"{key[0]} {key[1]}")


def _plotted(keys: list[tuple[str, str]], found: list[Difference]) -> list[tuple[str, str]]:
    """The task x metrics that get a plot: at most MAX_PLOTS (a plot costs ~0.1 s; a table of 20,000 tasks must
    not cost an hour), those with flagged differences first, then by |z| (`found` is in that order), then the rest
    in table order."""
    order = list(dict.fromkeys([(d.task, d.metric) for d in found] + keys))
    return order[:MAX_PLOTS]


def _num(v, fmt: str = ".4f") -> str:
    return "" if v is None else format(v, fmt)


def _page(runs: dict, found: list[Difference], population: list[PopulationStats], threshold: float,
          last_n: int) -> str:
    keys = list(dict.fromkeys(k for c in runs.values() for k in c))
    draw = plots.available()
    if not draw:
        plots.warn_missing("the comparison page")
    rows = "".join(
        f'<tr data-flagged="{int(d.flagged)}" data-task="{html_text(d.task)}" data-metric="{html_text(d.metric)}"'
        f' data-run="{html_text(d.run)}"{" style=background:#fdd" if d.flagged else ""}>'
        f"<td>{html_text(d.task)}</td><td>{html_text(d.metric)}</td><td>{html_text(d.run)}</td>"
        f"<td>{d.at:.4g}</td><td>{d.value:.4f}</td><td>{d.baseline_value:.4f}</td><td>{d.difference:+.4f}</td>"
        f"<td>{_num(d.noise)}</td><td>{_num(d.z, '+.2f')}</td><td>{'yes' if d.flagged else ''}</td></tr>"
        for d in found)
    signal = "".join(
        f'<tr data-population="1" data-task="{html_text(p.task)}" data-metric="{html_text(p.metric)}">'
        f"<td>{html_text(p.task)}</td><td>{html_text(p.metric)}</td><td>{p.runs}</td><td>{_num(p.signal)}</td>"
        f"<td>{_num(p.noise)}</td><td>{_num(p.snr, '.3g')}</td><td>{_num(p.decision_accuracy, '.2f')}</td>"
        f"<td>{p.pairs or ''}</td></tr>" for p in population)
    plotted = _plotted(keys, found)
    figures = "".join(f'<figure data-task="{html_text(t)}" data-metric="{html_text(m)}">{_figure((t, m), runs)}'
                      f"<figcaption>{html_text(t)} {html_text(m)}</figcaption></figure>"
                      for t, m in plotted) if draw else ""
    if draw and len(plotted) < len(keys):
        figures = (f"<p>Plots of the {len(plotted)} task x metrics with the largest differences (flagged first); the "
                   f"other {len(keys) - len(plotted)} are in the tables above and in {CSV_OUT}.</p>{figures}")
    names = list(runs)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>nano_eval compare</title>"
            "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:.5em}"
            "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px}</style>"
            f"</head><body><h1>nano_eval compare: {', '.join(html_text(n) for n in names)}</h1>"
            "<h2>Signal and noise across runs</h2><p>Heineman et al. (2025, arXiv 2508.13144): signal = "
            "max<sub>j,k</sub> |m<sub>j</sub> - m<sub>k</sub>| / mean(m), m<sub>j</sub> the mean of run j's last "
            f"{last_n} checkpoints; noise = mean over runs of std / mean of their last {last_n} checkpoints; SNR = "
            "signal / noise; decision accuracy = share of model pairs ordered alike at small and target scale "
            "(--small / --target; README).</p><table><tr><th>task</th><th>metric</th><th>runs</th><th>signal</th>"
            f"<th>noise</th><th>SNR</th><th>decision accuracy</th><th>pairs</th></tr>{signal}</table>"
            f"<h2>Differences from {html_text(names[0])}</h2><p>Each run is read at the last consumed-token count "
            "both it and the baseline reached: its recorded value there, or the value interpolated between its two "
            "checkpoints around it (nothing is extrapolated); flagged: |difference| &gt; "
            f"{threshold:g} &times; sqrt(se<sub>run</sub>&sup2; + se<sub>baseline</sub>&sup2;), the recorded "
            "stderrs.</p><table><tr><th>task</th><th>metric</th><th>run</th><th>at</th>"
            "<th>value</th><th>baseline</th><th>difference</th><th>noise</th><th>z</th><th>flagged</th></tr>"
            f"{rows}</table>{figures}</body></html>\n")
