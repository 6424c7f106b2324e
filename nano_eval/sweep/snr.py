"""Which tasks carry signal at this scale: signal, noise, signal-to-noise and monotonicity of each task x metric
learning curve of a sweep (the ranking behind the report's first table, `sweep_signal.csv` and the W&B table).

(Named snr.py: signals.py is the SIGINT/SIGTERM handling.) For one curve -- checkpoints i = 1..n in step order,
value y_i, stderr s_i (the metric's own: analytic for means, bootstrap for corpus metrics), x_i = ln(consumed
tokens_i), or ln(step_i) where a checkpoint's tokens are unknown; points with x undefined (step 0) only count for
tau:

    change  = y_n - y_1                                  raw total change over the sweep
    slope   = least-squares slope of y on x              change per e-fold of training tokens
    signal  = |slope| * (x_n - x_1)                      the change the fitted trend explains over the sweep
    jitter  = sqrt(sum r_i^2 / (K - 2)), r = residuals of a least-squares line through the last K points
              (K = min(n, last_k), default 10): checkpoint-to-checkpoint noise of the detrended curve
    stderr  = mean s_i over the same last K checkpoints  the noise of scoring a finite set of documents
    noise   = jitter when K >= 3, else stderr
    snr     = signal / noise
    tau     = Kendall tau-b of (step, y): +1 rises at every checkpoint, -1 falls, 0 no order
              (lower-is-better metrics such as bits_per_byte improve with tau near -1)

AI2's "Signal and Noise" (Heineman et al., 2025, arXiv 2508.13144) defines signal as the spread of final scores
across models relative to their mean and noise as the std of one run's last checkpoints relative to their mean;
here the population is one run's checkpoints, so the spread is the fitted trend's, the noise is detrended, and
the relative forms' common 1/mean cancels in the ratio. Monotonicity as a task-selection criterion: DataDecide
(Magnusson et al., 2025) and HF FineTasks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

LAST_K = 10

COLUMNS = ("rank", "task", "metric", "checkpoints", "x", "first", "last", "change", "slope", "signal", "jitter",
           "stderr", "noise", "snr", "kendall_tau")


@dataclass(frozen=True)
class CurveStats:
    task: str
    metric: str
    checkpoints: int
    x: str  # "ln_tokens" | "ln_step": what the slope is measured against
    first: float
    last: float
    change: float
    slope: float | None
    signal: float | None
    jitter: float | None  # None with fewer than 3 points in the window
    stderr: float | None  # None when the metric records none
    noise: float | None
    snr: float | None
    kendall_tau: float | None


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; needs two distinct xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def detrended_jitter(xs: list[float], ys: list[float]) -> float | None:
    """Residual std (K - 2 degrees of freedom) of the least-squares line through the points; None below 3."""
    if len(xs) < 3 or len(set(xs)) < 2:
        return None
    a, b = line_fit(xs, ys)
    return math.sqrt(sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / (len(xs) - 2))


def kendall_tau(xs: list[float], ys: list[float]) -> float | None:
    """Kendall's tau-b (ties in either variable accounted for); None when either variable is constant."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator else None


def curve_stats(task: str, metric: str, points: list[tuple[int, int | None, float, float | None]],
                last_k: int = LAST_K) -> CurveStats | None:
    """Statistics of one curve: points are (step, consumed tokens or None, value, stderr or None), any order;
    None for fewer than two valued points."""
    pts = sorted((p for p in points if p[2] is not None and math.isfinite(p[2])), key=lambda p: p[0])
    if len(pts) < 2:
        return None
    use_tokens = all(t for _, t, _, _ in pts)
    x_name = "ln_tokens" if use_tokens else "ln_step"
    fit = [(math.log(t if use_tokens else s), v) for s, t, v, _ in pts if (t if use_tokens else s) > 0]
    xs, ys = [x for x, _ in fit], [y for _, y in fit]
    slope = line_fit(xs, ys)[1] if len(set(xs)) >= 2 else None
    signal = abs(slope) * (xs[-1] - xs[0]) if slope is not None else None
    window = fit[-last_k:]
    jitter = detrended_jitter([x for x, _ in window], [y for _, y in window])
    errs = [e for _, _, _, e in pts[-last_k:] if e is not None and math.isfinite(e)]
    stderr = sum(errs) / len(errs) if errs else None
    noise = jitter if jitter is not None else stderr
    snr = signal / noise if signal is not None and noise else None
    tau = kendall_tau([float(s) for s, _, _, _ in pts], [v for _, _, v, _ in pts])
    return CurveStats(task, metric, len(pts), x_name, pts[0][2], pts[-1][2], pts[-1][2] - pts[0][2], slope, signal,
                      jitter, stderr, noise, snr, tau)


Curve = list[tuple[int, int | None, float, float | None]]  # (step, consumed tokens, value, stderr), step order


def table_curves(rows: list[dict]) -> dict[tuple[str, str], Curve]:
    """{(task, metric): curve} of a sweep table (table.table_rows / read_table), in table order; error rows and
    rows without a value are left out."""
    curves: dict[tuple[str, str], Curve] = {}
    for r in rows:
        if not r.get("error") and r["value"] is not None:
            curves.setdefault((r["task"], r["metric"]), []).append(
                (r["step"], r["consumed_tokens"], r["value"], r["stderr"]))
    return {key: sorted(points, key=lambda p: p[0]) for key, points in curves.items()}


def ranked(rows: list[dict], last_k: int = LAST_K) -> list[CurveStats]:
    """Every task x metric of a sweep table (table.table_rows / read_table; error rows ignored), highest
    signal-to-noise first (curves without an SNR last, in table order)."""
    stats = [s for (task, metric), pts in table_curves(rows).items() if (s := curve_stats(task, metric, pts, last_k))]
    return sorted(stats, key=lambda s: -s.snr if s.snr is not None else math.inf)


def signal_rows(stats: list[CurveStats]) -> list[dict]:
    """One dict per curve with COLUMNS as keys (rank 1 = most signal)."""
    return [{"rank": k, **asdict(s)} for k, s in enumerate(stats, start=1)]
