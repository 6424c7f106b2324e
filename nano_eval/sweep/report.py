"""Learning curves of a sweep: one PNG per (task, metric) (stderr band around the curve) and one self-contained HTML
page (images inlined as base64 data URIs, plus the numbers as tables), built from the consolidated table. The page
opens with the tasks ranked by trend / noise, improving curves first (snr.py, part 2).

The plots need matplotlib (plots.py; the `report` extra): without it the page has the tables only, no PNG is
written, and one warning says so.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from nano_eval.sweep import plots
from nano_eval.sweep.plots import html_text
from nano_eval.sweep.metric_kinds import bounded
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
    """Write `<out>/report/*.png` (with matplotlib) and `<out>/report/index.html`; returns the HTML path. Every
    write is local_files.atomic_write_bytes below `out`: a `report` that is a symlink (or any non-folder) is
    refused, never written through."""
    out = Path(out_dir)
    everything = read_table(out)
    rows = [r for r in everything if not r["error"]]
    failures = [r for r in everything if r["error"]]
    data = curves(rows)
    figures: dict[tuple[str, str], str] = {}  # (task, metric) -> <img> markup
    if plots.available():
        for task, metrics in data.items():
            for metric, points in metrics.items():
                series = {metric: [(s, v, e) for s, v, e in points if v is not None]}
                png = plots.curves_png(series, f"{task}  {metric}", "training step", metric,
                                       unit_interval=bounded(metric))
                atomic_write_bytes(out / REPORT_DIR / f"{file_stem(task, metric)}.png", png, root=out)
                figures[task, metric] = plots.img_tag(png, f"{task} {metric}")
    else:
        plots.warn_missing("the sweep report")
    page = _html(out, rows, data, figures, failures, ranked(rows))
    atomic_write_text(out / REPORT_DIR / HTML_NAME, page, root=out)
    return out / REPORT_DIR / HTML_NAME


def _fmt(value, err) -> str:
    if value is None:
        return ""
    return f"{value:.4f}" + (f" ± {err:.4f}" if err is not None else "")


def _signal_section(stats: list[CurveStats]) -> list[str]:
    """The ranked "which tasks moved" table (formulas: nano_eval.sweep.snr part 2, README)."""
    def num(v, fmt=".4g"):
        return "" if v is None else format(v, fmt)

    parts = ['<section data-signal="1"><h2>Which tasks moved over this run</h2>'
             "<p>Improving curves first, then flat, then worsening ones (a metric that got worse is never ranked "
             "as signal), each by trend / noise: trend = |slope| &times; span of ln(consumed tokens) (the change "
             "the fitted line explains), noise = std of the detrended curve over the last checkpoints (the "
             "metric's stderr when there are fewer than 3), Kendall &tau; of value vs step (monotonicity). This "
             "is one run; the signal-to-noise ratio of Heineman et al. (2025) needs several runs: "
             "<code>nano_eval compare</code>. Formulas and sources: README.</p>",
             "<table><tr><th>rank</th><th>task</th><th>metric</th><th>direction</th><th>checkpoints</th>"
             "<th>change</th><th>slope / ln tokens</th><th>trend</th><th>noise (jitter)</th><th>stderr</th>"
             "<th>trend / noise</th><th>Kendall &tau;</th></tr>"]
    for k, st in enumerate(stats, start=1):
        parts.append(f'<tr data-rank="{k}" data-task="{html_text(st.task)}" data-metric="{html_text(st.metric)}"'
                     f' data-direction="{st.direction}">'
                     f"<td>{k}</td><td>{html_text(st.task)}</td><td>{html_text(st.metric)}</td>"
                     f"<td>{st.direction}</td><td>{st.checkpoints}</td><td>{num(st.change)}</td>"
                     f"<td>{num(st.slope)}</td><td>{num(st.trend)}</td><td>{num(st.jitter)}</td>"
                     f"<td>{num(st.stderr)}</td><td>{num(st.trend_to_noise, '.3g')}</td>"
                     f"<td>{num(st.kendall_tau, '.2f')}</td></tr>")
    parts.append("</table></section>")
    return parts


def _html(out: Path, rows: list[dict], data: dict, figures: dict, failures: list[dict],
          stats: list[CurveStats]) -> str:
    steps = sorted({(r["step"], r["checkpoint"], r["consumed_tokens"]) for r in rows})
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>nano_eval sweep: {html_text(out.name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;margin:.5em}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px;text-align:right}"
        "</style></head><body>",
        f"<h1>nano_eval sweep: {html_text(str(out))}</h1>",
        f"<p>{len(steps)} checkpoints, steps {steps[0][0] if steps else '-'} to {steps[-1][0] if steps else '-'}; "
        f"generated {datetime.now(timezone.utc).isoformat(timespec='seconds')}.</p>",
    ]
    if failures:
        parts.append('<section data-failed="1"><h2>Failed checkpoints</h2><table><tr><th>checkpoint</th><th>step</th>'
                     '<th style="text-align:left">error</th></tr>')
        parts += [f'<tr data-step="{r["step"]}"><td>{html_text(r["checkpoint"])}</td><td>{r["step"]}</td>'
                  f'<td style="text-align:left">{html_text(r["error"])}</td></tr>' for r in failures]
        parts.append("</table></section>")
    if stats:
        parts += _signal_section(stats)
    for task, metrics in data.items():
        parts.append(f'<section data-task="{html_text(task)}"><h2>{html_text(task)}</h2>')
        for metric in metrics:
            parts.append(f'<figure data-task="{html_text(task)}" data-metric="{html_text(metric)}">'
                         f"{figures.get((task, metric), '')}<figcaption>{html_text(metric)}</figcaption></figure>")
        by_step = {m: {s: (v, e) for s, v, e in pts} for m, pts in metrics.items()}
        parts.append("<table><tr><th>checkpoint</th><th>step</th><th>consumed tokens</th>"
                     + "".join(f"<th>{html_text(m)}</th>" for m in metrics) + "</tr>")
        for step, name, tokens in steps:
            cells = "".join(f"<td>{_fmt(*by_step[m].get(step, (None, None)))}</td>" for m in metrics)
            parts.append(f'<tr data-step="{step}"><td>{html_text(name)}</td><td>{step}</td>'
                         f"<td>{'' if tokens is None else tokens}</td>{cells}</tr>")
        parts.append("</table></section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
