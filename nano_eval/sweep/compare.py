"""Compare the sweeps of several training runs: `nano_eval compare OUT_A OUT_B ... --output-dir CMP`.

Reads each sweep's `sweep_results.csv`; for every task x metric the runs share it draws their curves on one plot
against consumed tokens (steps when a run's tokens are unknown), with stderr bands, and compares each run with
the first one (the baseline) where both have been: at x* = the smaller of the two runs' last x,

    value(x*) = a + b ln x*     least-squares line through the run's last K (10) checkpoints at or before x*
    se(x*)    = jitter * sqrt(1/K + (ln x* - mean ln x)^2 / sum (ln x - mean ln x)^2)
                                 jitter: the residual std of that line (snr.py), i.e. the checkpoint noise
    difference = value_run(x*) - value_baseline(x*),   z = difference / sqrt(se_run^2 + se_baseline^2)
    flagged when |z| > threshold (default 2)

With fewer than 3 checkpoints a run's value is interpolated linearly in ln x and its se is the metric's stderr
at the nearest checkpoint.

Writes `<CMP>/compare.csv` (one row per task x metric x run) and `<CMP>/index.html` (the plots, inlined, and the
table, flagged rows first).
"""

from __future__ import annotations

import base64
import csv
import html
import io
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from nano_eval.errors import NanoEvalError
from nano_eval.sweep.snr import LAST_K, Curve, detrended_jitter, line_fit, table_curves
from nano_eval.sweep.table import CSV_NAME, read_table
from nano_eval.tracking.files import atomic_write_text

COLUMNS = ("task", "metric", "run", "baseline", "x", "at", "value", "baseline_value", "difference", "noise", "z",
           "flagged")
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


@dataclass(frozen=True)
class Difference:
    task: str
    metric: str
    run: str
    baseline: str
    x: str  # "consumed_tokens" | "step"
    at: float  # x*: the last x both runs reached
    value: float  # value(x*) of the run
    baseline_value: float
    difference: float
    noise: float | None  # sqrt(se_run^2 + se_baseline^2)
    z: float | None
    flagged: bool


def load_curves(out_dir: Path) -> dict[tuple[str, str], Curve]:
    """{(task, metric): curve} of one sweep output folder."""
    if not (Path(out_dir) / CSV_NAME).exists():
        raise NanoEvalError(f"{out_dir} holds no {CSV_NAME}. Fix: pass the --output-dir of a `nano_eval sweep`.")
    return table_curves(read_table(out_dir))


def interpolate(points: list[tuple[float, float]], at: float) -> float | None:
    """The curve's value at `at`, linear in ln x between the two points around it (None outside the curve)."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= at <= x1:
            if x1 == x0 or x0 <= 0:
                return y1 if at == x1 else y0
            return y0 + (y1 - y0) * (math.log(at) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return points[0][1] if len(points) == 1 and points[0][0] == at else None


def value_at(curve: Curve, at: float, use_tokens: bool, last_k: int = LAST_K) -> tuple[float, float | None] | None:
    """(value, its standard error) of the curve at x = `at` (see the module docstring); None outside it."""
    pts = [(float(t if use_tokens else s), v, e) for s, t, v, e in curve]
    if not pts or not pts[0][0] <= at <= pts[-1][0]:
        return None
    window = [(math.log(x), y) for x, y, _ in pts if 0 < x <= at][-last_k:]
    xs, ys = [x for x, _ in window], [y for _, y in window]
    jitter = detrended_jitter(xs, ys)
    if jitter is not None:
        a, b = line_fit(xs, ys)
        mx = sum(xs) / len(xs)
        lever = (math.log(at) - mx) ** 2 / sum((x - mx) ** 2 for x in xs)
        return a + b * math.log(at), jitter * math.sqrt(1 / len(xs) + lever)
    nearest = min(pts, key=lambda p: abs(p[0] - at))
    return interpolate([(x, y) for x, y, _ in pts], at), nearest[2]


def differences(runs: dict[str, dict[tuple[str, str], Curve]], threshold: float = 2.0) -> list[Difference]:
    """Every run against the first, per shared task x metric (flagged first, then by |z|)."""
    names = list(runs)
    base_name, out = names[0], []
    for key, base in runs[base_name].items():
        for name in names[1:]:
            other = runs[name].get(key)
            if not other:
                continue
            use_tokens = all(t for _, t, _, _ in base + other)
            last = [float(c[-1][1] if use_tokens else c[-1][0]) for c in (base, other)]
            at = min(last)
            va, vb = value_at(base, at, use_tokens), value_at(other, at, use_tokens)
            if va is None or vb is None:
                continue  # the runs do not overlap
            noise = math.sqrt(va[1] ** 2 + vb[1] ** 2) if va[1] is not None and vb[1] is not None else None
            z = (vb[0] - va[0]) / noise if noise else None
            out.append(Difference(*key, name, base_name, "consumed_tokens" if use_tokens else "step", at, vb[0],
                                  va[0], vb[0] - va[0], noise, z, z is not None and abs(z) > threshold))
    return sorted(out, key=lambda d: (not d.flagged, -abs(d.z or 0)))


def write_comparison(out_dirs: list[str], labels: list[str] | None, dest: str, threshold: float = 2.0
                     ) -> list[Difference]:
    """Compare the sweeps in `out_dirs` (first = baseline); write compare.csv and index.html into `dest`."""
    labels = labels or [Path(d).resolve().name for d in out_dirs]
    if len(labels) != len(out_dirs) or len(set(labels)) != len(labels):
        raise NanoEvalError(f"--labels needs one distinct name per sweep folder ({len(out_dirs)}), got {labels}. "
                            "Fix: --labels a,b,... in the folders' order.")
    runs = {label: load_curves(Path(d)) for label, d in zip(labels, out_dirs)}
    found = differences(runs, threshold)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: ("" if v is None else v) for k, v in asdict(d).items()} for d in found)
    atomic_write_text(Path(dest) / "compare.csv", text.getvalue())
    atomic_write_text(Path(dest) / "index.html", _page(runs, found, threshold))
    return found


def _plot(key: tuple[str, str], runs: dict[str, dict[tuple[str, str], Curve]]) -> str:
    """One figure (an <img> PNG, or an <svg> without matplotlib) with every run's curve of `key`."""
    curves = {name: c[key] for name, c in runs.items() if key in c}
    use_tokens = all(t for c in curves.values() for _, t, _, _ in c)
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return _svg(curves, use_tokens, f"{key[0]} {key[1]}")
    fig = Figure(figsize=(5.5, 3.2), dpi=100)
    ax = fig.subplots()
    for (name, curve), color in zip(curves.items(), COLORS * 10):
        xs = [t if use_tokens else s for s, t, _, _ in curve]
        ys = [v for _, _, v, _ in curve]
        ax.plot(xs, ys, marker="o", markersize=3, color=color, label=name)
        errs = [e or 0.0 for _, _, _, e in curve]
        ax.fill_between(xs, [y - e for y, e in zip(ys, errs)], [y + e for y, e in zip(ys, errs)], color=color,
                        alpha=0.15)
    if use_tokens:
        ax.set_xscale("log")
    ax.set_xlabel("consumed tokens" if use_tokens else "training step")
    ax.set_title(f"{key[0]}  {key[1]}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return f'<img alt="{html.escape(key[0])} {html.escape(key[1])}" src="data:image/png;base64,' \
           f'{base64.b64encode(buf.getvalue()).decode()}">'


def _svg(curves: dict[str, Curve], use_tokens: bool, label: str, width: int = 400, height: int = 200,
         pad: int = 24) -> str:
    pts = {n: [(math.log(max(t if use_tokens else s, 1)), v) for s, t, v, _ in c] for n, c in curves.items()}
    xs = [x for p in pts.values() for x, _ in p]
    ys = [y for p in pts.values() for _, y in p]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx, sy = (width - 2 * pad) / ((x1 - x0) or 1), (height - 2 * pad) / ((y1 - y0) or 1)
    lines = "".join(
        f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
        + " ".join(f"{pad + (x - x0) * sx:.1f},{height - pad - (y - y0) * sy:.1f}" for x, y in p) + '"/>'
        for p, color in zip(pts.values(), COLORS * 10))
    legend = ", ".join(f'<tspan fill="{c}">{html.escape(n)}</tspan>' for n, c in zip(pts, COLORS * 10))
    return (f'<svg role="img" aria-label="{html.escape(label)}" width="{width}" height="{height}">{lines}'
            f'<text x="{pad}" y="14" font-size="11">{legend}</text></svg>')


def _page(runs: dict, found: list[Difference], threshold: float) -> str:
    keys = list(dict.fromkeys(k for c in runs.values() for k in c))
    if "matplotlib" not in sys.modules:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("nano_eval: warning: matplotlib is not installed: the comparison draws SVG curves. Fix: pip "
                  "install matplotlib", file=sys.stderr)
    rows = "".join(
        f'<tr data-flagged="{int(d.flagged)}" data-task="{html.escape(d.task)}" data-metric="{html.escape(d.metric)}"'
        f' data-run="{html.escape(d.run)}"{" style=background:#fdd" if d.flagged else ""}>'
        f"<td>{html.escape(d.task)}</td><td>{html.escape(d.metric)}</td><td>{html.escape(d.run)}</td>"
        f"<td>{d.at:.4g}</td><td>{d.value:.4f}</td><td>{d.baseline_value:.4f}</td><td>{d.difference:+.4f}</td>"
        f"<td>{'' if d.noise is None else format(d.noise, '.4f')}</td>"
        f"<td>{'' if d.z is None else format(d.z, '+.2f')}</td><td>{'yes' if d.flagged else ''}</td></tr>"
        for d in found)
    figures = "".join(f'<figure data-task="{html.escape(t)}" data-metric="{html.escape(m)}">{_plot((t, m), runs)}'
                      f"<figcaption>{html.escape(t)} {html.escape(m)}</figcaption></figure>" for t, m in keys)
    names = list(runs)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>nano_eval compare</title>"
            "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:.5em}"
            "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px}</style>"
            f"</head><body><h1>nano_eval compare: {', '.join(html.escape(n) for n in names)}</h1>"
            f"<p>Baseline: {html.escape(names[0])}. Each run is read at the last consumed-token count both it and "
            "the baseline reached, from a line through its last checkpoints there; flagged: |difference| &gt; "
            f"{threshold:g} &times; sqrt(se<sub>run</sub>&sup2; + se<sub>baseline</sub>&sup2;) (README).</p>"
            "<table><tr><th>task</th><th>metric</th><th>run</th><th>at</th>"
            "<th>value</th><th>baseline</th><th>difference</th><th>noise</th><th>z</th><th>flagged</th></tr>"
            f"{rows}</table>{figures}</body></html>\n")
