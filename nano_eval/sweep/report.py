"""Learning curves of a sweep: one PNG per (task, metric) (stderr band around the curve) and one self-contained HTML
page (images inlined as base64 data URIs, plus the numbers as tables), built from the consolidated table. The page
opens with the tasks ranked by signal-to-noise (snr.py).

matplotlib is optional (`pip install matplotlib`): without it the page draws each curve as an inline SVG polyline
and no PNG is written (one warning says so).
"""

from __future__ import annotations

import base64
import html
import io
import math
import sys
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from nano_eval.sweep.snr import CurveStats, ranked
from nano_eval.sweep.table import read_table
from nano_eval.tracking.files import atomic_write_bytes, atomic_write_text, safe_file_name

REPORT_DIR, HTML_NAME = "report", "index.html"


def curves(rows: list[dict]) -> dict[str, dict[str, list[tuple[int, float | None, float | None]]]]:
    """{task: {metric: [(step, value, stderr), ...] in step order}}, tasks and metrics in table order."""
    out: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        out[r["task"]][r["metric"]].append((r["step"], r["value"], r["stderr"]))
    return {t: {m: sorted(points) for m, points in ms.items()} for t, ms in out.items()}


def file_stem(task: str, metric: str) -> str:
    """`demo|arithmetic|0` + `acc` -> `demo_arithmetic_0__acc` (portable file names)."""
    return safe_file_name(f"{task}__{metric}")


def write_report(out_dir: str | Path) -> Path:
    """Write `<out>/report/*.png` and `<out>/report/index.html`; returns the HTML path."""
    out = Path(out_dir)
    everything = read_table(out)
    rows = [r for r in everything if not r["error"]]
    failures = [r for r in everything if r["error"]]
    data = curves(rows)
    plot = _png_plotter()
    figures: dict[tuple[str, str], str] = {}  # (task, metric) -> <img> or <svg> markup
    for task, metrics in data.items():
        for metric, points in metrics.items():
            label = f"{task} {metric}"
            if plot is not None:
                png = plot(task, metric, points)
                atomic_write_bytes(out / REPORT_DIR / f"{file_stem(task, metric)}.png", png)
                src = "data:image/png;base64," + base64.b64encode(png).decode()
                figures[task, metric] = f'<img alt="{html.escape(label)}" src="{src}">'
            else:
                figures[task, metric] = _svg(points, label)
    page = _html(out, rows, data, figures, failures, ranked(rows))
    atomic_write_text(out / REPORT_DIR / HTML_NAME, page)
    return out / REPORT_DIR / HTML_NAME


def _png_plotter():
    """A function (task, metric, points) -> PNG bytes, or None (with one warning) when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("nano_eval: warning: matplotlib is not installed: the sweep report draws SVG curves and writes no PNG. "
              "Fix: pip install matplotlib", file=sys.stderr)
        return None

    def plot(task: str, metric: str, points: list) -> bytes:
        fig = Figure(figsize=(5, 3), dpi=100)  # no pyplot: no global state, no GUI backend
        ax = fig.subplots()
        pts = [(s, v, e) for s, v, e in points if v is not None]
        steps, values = [p[0] for p in pts], [p[1] for p in pts]
        ax.plot(steps, values, marker="o")
        if any(e is not None for _, _, e in pts):
            lo = [v - (e or 0) for _, v, e in pts]
            hi = [v + (e or 0) for _, v, e in pts]
            ax.fill_between(steps, lo, hi, alpha=0.2)
        ax.set_title(f"{task}  {metric}", fontsize=9)
        ax.set_xlabel("training step")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

    return plot


def _svg(points: list, label: str, width: int = 360, height: int = 180, pad: int = 24) -> str:
    pts = [(s, v) for s, v, _ in points if v is not None and math.isfinite(v)]
    if not pts:
        return f'<svg role="img" aria-label="{html.escape(label)}" width="{width}" height="{height}"></svg>'
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    sx = (width - 2 * pad) / ((x1 - x0) or 1)
    sy = (height - 2 * pad) / ((y1 - y0) or 1)
    def xy(s, v):
        return f"{pad + (s - x0) * sx:.1f},{height - pad - (v - y0) * sy:.1f}"

    coords = " ".join(xy(s, v) for s, v in pts)
    band = [(s, v, e) for s, v, e in points if v is not None and e is not None and math.isfinite(v)]
    polygon = (f'<polygon fill="#1f77b4" fill-opacity="0.2" points="'
               + " ".join([xy(s, min(y1, v + e)) for s, v, e in band]
                          + [xy(s, max(y0, v - e)) for s, v, e in reversed(band)]) + '"/>') if len(band) > 1 else ""
    return (f'<svg role="img" aria-label="{html.escape(label)}" width="{width}" height="{height}">{polygon}'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{coords}"/>'
            f'<text x="{pad}" y="14" font-size="11">{y1:.4g}</text>'
            f'<text x="{pad}" y="{height - 4}" font-size="11">{y0:.4g} (step {x0} .. {x1})</text></svg>')


def _fmt(value, err) -> str:
    if value is None:
        return ""
    return f"{value:.4f}" + (f" ± {err:.4f}" if err is not None else "")


def _signal_section(stats: list[CurveStats]) -> list[str]:
    """The ranked "which tasks carry signal" table (formulas: nano_eval.sweep.snr, README)."""
    def num(v, fmt=".4g"):
        return "" if v is None else format(v, fmt)

    parts = ['<section data-signal="1"><h2>Which tasks carry signal at this scale</h2>'
             "<p>Ranked by signal-to-noise: signal = |slope| &times; span of ln(consumed tokens) (the change the "
             "fitted trend explains), noise = std of the detrended curve over the last checkpoints (the metric's "
             "stderr when there are fewer than 3), Kendall &tau; of value vs step (monotonicity). Formulas and "
             "sources: README, \"Sweep a training run's checkpoints\".</p>",
             "<table><tr><th>rank</th><th>task</th><th>metric</th><th>checkpoints</th><th>change</th>"
             "<th>slope / ln tokens</th><th>signal</th><th>noise (jitter)</th><th>stderr</th><th>SNR</th>"
             "<th>Kendall &tau;</th></tr>"]
    for k, st in enumerate(stats, start=1):
        parts.append(f'<tr data-rank="{k}" data-task="{html.escape(st.task)}" data-metric="{html.escape(st.metric)}">'
                     f"<td>{k}</td><td>{html.escape(st.task)}</td><td>{html.escape(st.metric)}</td>"
                     f"<td>{st.checkpoints}</td><td>{num(st.change)}</td><td>{num(st.slope)}</td>"
                     f"<td>{num(st.signal)}</td><td>{num(st.jitter)}</td><td>{num(st.stderr)}</td>"
                     f"<td>{num(st.snr, '.3g')}</td><td>{num(st.kendall_tau, '.2f')}</td></tr>")
    parts.append("</table></section>")
    return parts


def _html(out: Path, rows: list[dict], data: dict, figures: dict, failures: list[dict],
          stats: list[CurveStats]) -> str:
    steps = sorted({(r["step"], r["checkpoint"], r["consumed_tokens"]) for r in rows})
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>nano_eval sweep: {html.escape(out.name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:.5em}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
        "</style></head><body>",
        f"<h1>nano_eval sweep: {html.escape(str(out))}</h1>",
        f"<p>{len(steps)} checkpoints, steps {steps[0][0] if steps else '-'} to {steps[-1][0] if steps else '-'}; "
        f"generated {datetime.now(timezone.utc).isoformat(timespec='seconds')}.</p>",
    ]
    if failures:
        parts.append('<section data-failed="1"><h2>Failed checkpoints</h2><table><tr><th>checkpoint</th><th>step</th>'
                     '<th style="text-align:left">error</th></tr>')
        parts += [f'<tr data-step="{r["step"]}"><td>{html.escape(r["checkpoint"])}</td><td>{r["step"]}</td>'
                  f'<td style="text-align:left">{html.escape(r["error"])}</td></tr>' for r in failures]
        parts.append("</table></section>")
    if stats:
        parts += _signal_section(stats)
    for task, metrics in data.items():
        parts.append(f'<section data-task="{html.escape(task)}"><h2>{html.escape(task)}</h2>')
        for metric in metrics:
            parts.append(f'<figure data-task="{html.escape(task)}" data-metric="{html.escape(metric)}">'
                         f"{figures[task, metric]}<figcaption>{html.escape(metric)}</figcaption></figure>")
        by_step = {m: {s: (v, e) for s, v, e in pts} for m, pts in metrics.items()}
        parts.append("<table><tr><th>checkpoint</th><th>step</th><th>consumed tokens</th>"
                     + "".join(f"<th>{html.escape(m)}</th>" for m in metrics) + "</tr>")
        for step, name, tokens in steps:
            cells = "".join(f"<td>{_fmt(*by_step[m].get(step, (None, None)))}</td>" for m in metrics)
            parts.append(f'<tr data-step="{step}"><td>{html.escape(name)}</td><td>{step}</td>'
                         f"<td>{'' if tokens is None else tokens}</td>{cells}</tr>")
        parts.append("</table></section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
