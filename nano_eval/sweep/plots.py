"""The learning-curve plots of the sweep report (report.py) and of `nano_eval compare` (compare.py): matplotlib
only, the `report` extra (`pip install -e '.[report]'`). Without matplotlib the pages are written without plots
and one warning says so (warn_missing); nothing else changes.
"""

from __future__ import annotations

import base64
import html
import io
import sys

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")
INSTALL = "pip install -e '.[report]'"

Series = list[tuple[float, float, float | None]]  # (x, value, stderr or None), x order


def html_text(text) -> str:
    """A name from a file (task, metric, run, checkpoint) as page text: control characters escaped
    (local_files.printable: no raw ESC byte reaches the page), then HTML-escaped (quotes too, for attributes)."""
    from nano_eval.local_files import printable

    return html.escape(printable(str(text)))


def _label(text) -> str:
    """A name as matplotlib text: control characters escaped, `$` taken literally (not as mathtext: `$\\x$` in a
    task name would fail the drawing)."""
    from nano_eval.local_files import printable

    return printable(str(text)).replace("$", r"\$")


def available() -> bool:
    """True when matplotlib imports (its object API, no pyplot: no global state, no GUI backend)."""
    try:
        from matplotlib.figure import Figure  # noqa: F401
    except ImportError:
        return False
    return True


def warn_missing(what: str) -> None:
    """The one warning a page without plots gives: `what` names the page."""
    print(f"nano_eval: warning: matplotlib is not installed: {what} has no plots. Fix: {INSTALL}", file=sys.stderr)


def curves_png(series: dict[str, Series], title: str, xlabel: str, ylabel: str = "", log_x: bool = False,
               size: tuple[float, float] = (5.0, 3.0), unit_interval: bool = False) -> bytes:
    """A PNG of one line per series (a legend when there are several), each with a +-stderr band where it records
    one, the band cut to [0, 1] when `unit_interval` (a bounded metric: metric_kinds.bounded); needs matplotlib
    (check available() first)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=100)
    ax = fig.subplots()
    for (name, points), color in zip(series.items(), COLORS * (len(series) // len(COLORS) + 1)):
        xs, ys = [x for x, _, _ in points], [y for _, y, _ in points]
        ax.plot(xs, ys, marker="o", markersize=3, color=color, label=_label(name))
        if any(e is not None for _, _, e in points):
            lo, hi = [y - (e or 0) for _, y, e in points], [y + (e or 0) for _, y, e in points]
            if unit_interval:
                lo, hi = [max(0.0, v) for v in lo], [min(1.0, v) for v in hi]
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2)
    if log_x:
        ax.set_xscale("log")
    ax.set_title(_label(title), fontsize=9)
    ax.set_xlabel(_label(xlabel))
    ax.set_ylabel(_label(ylabel))
    if len(series) > 1:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def img_tag(png: bytes, alt: str) -> str:
    """An <img> with the PNG inlined as a base64 data URI (the page stays self-contained)."""
    return f'<img alt="{html_text(alt)}" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
