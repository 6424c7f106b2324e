"""Signal and noise of a sweep's learning curves, two kinds.

(Named snr.py: signals.py is the SIGINT/SIGTERM handling.)

1. Across runs (a population of models), as defined by Heineman et al., "Signal and Noise: A Framework for Reducing
   Uncertainty in Language Model Evaluation" (AI2, 2025, arXiv 2508.13144; code: allenai/signal-and-noise,
   snr/metrics.py and snr/snr_simple.py). Used by `nano_eval compare` (compare.py). For one task x metric and runs
   j = 1..M (the --small runs when given, as the paper's SNR is taken at one scale; else every run compared),
   m_j = the mean of run j's last n checkpoints (n = --last-n, default 5, the paper's small-scale n):

       signal   = max_{j,k} |m_j - m_k| / |mean_j m_j|       relative dispersion of the runs' scores
       noise_j  = std(last n of run j) / |mean(last n of run j)|   relative std of one run's last checkpoints
                  (std with ddof = 0, numpy's default, as the paper's code)
       noise    = mean_j noise_j                              the population's noise
       SNR      = signal / noise
       decision accuracy = share of the model pairs (i, j), i < j, whose order at small scale agrees with their
                  order at target scale: [s_i > s_j] == [t_i > t_j], s and t the final (last checkpoint) scores of
                  model i's small-scale and target-scale runs (the paper's decision_acc_fast; a pair's agreement
                  does not depend on which direction is better)

   Choices that differ from the paper's code: its small-scale noise takes the std of the last-n scores of all runs
   pooled into one array (which also holds the spread between runs); here each run's relative std is computed
   alone and averaged, so noise is checkpoint-to-checkpoint noise only. The denominators take |mean| so that a
   negative-valued metric still gives a positive ratio (the same as the paper's for positive metrics).

2. Along one run (the sweep report, `sweep_signal.csv`, the W&B table `sweep/signal_to_noise`): how far a metric
   moved over the sweep against its checkpoint-to-checkpoint jitter. This is no SNR in the paper's sense (one run
   is no population of models); it is named trend and jitter. For one curve -- checkpoints i = 1..n in step order,
   value y_i, stderr s_i (the metric's own), x_i = ln(consumed tokens_i), or ln(step_i) where a checkpoint's
   tokens are unknown; points with x undefined (step 0) only count for tau:

       change    = y_n - y_1                              raw total change over the sweep
       slope     = least-squares slope of y on x          change per e-fold of training tokens
       trend     = |slope| * (x_n - x_1)                  the change the fitted line explains over the sweep
       jitter    = sqrt(sum r_i^2 / (K - 2)), r = residuals of a least-squares line through the last K points
                   (K = min(n, last_k), default 10): checkpoint-to-checkpoint noise of the detrended curve
       stderr    = mean s_i over the same last K checkpoints   the noise of scoring a finite set of documents
       noise     = jitter when K >= 3, else stderr
       trend_to_noise = trend / noise
       slope_se  = noise / sqrt(sum (x_i - mean x)^2)     the slope's standard error
       direction = "flat" when |slope| <= 2 slope_se (or no slope); else "improves" when the slope goes the
                   metric's better way (up, or down for lower-is-better metrics: metric_kinds.py), "worsens"
       tau       = Kendall tau-b of (step, y): +1 rises at every checkpoint, -1 falls, 0 no order

   Ranked: improving curves first, then flat ones, then worsening ones, each by trend_to_noise, highest first; a
   metric that gets worse over training is never ranked as signal. Monotonicity as a task-selection criterion:
   DataDecide (Magnusson et al., 2025) and HF FineTasks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from nano_eval.sweep.metric_kinds import lower_is_better

LAST_K = 10  # one-run jitter window
LAST_N = 5  # across-run noise window (the paper's small-scale n)

COLUMNS = ("rank", "task", "metric", "direction", "checkpoints", "x", "first", "last", "change", "slope", "trend",
           "jitter", "stderr", "noise", "trend_to_noise", "kendall_tau")

Curve = list[tuple[int, int | None, float, float | None]]  # (step, consumed tokens, value, stderr), step order


# ---- across runs: Heineman et al. 2025 ------------------------------------------------------------------------------

def relative_dispersion(scores: list[float]) -> float | None:
    """The paper's signal: max_{j,k} |m_j - m_k| / |mean(m)| of one score per model; None below 2 scores or when
    the mean is 0."""
    if len(scores) < 2:
        return None
    mean = sum(scores) / len(scores)
    return (max(scores) - min(scores)) / abs(mean) if mean else None


def relative_std(values: list[float]) -> float | None:
    """The paper's noise of one run: std(values) / |mean(values)|, std with ddof = 0; None below 2 values or when
    the mean is 0."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
    return std / abs(mean) if mean else None


def decision_accuracy(small: list[float], target: list[float]) -> float | None:
    """Share of the pairs (i, j), i < j, of models with [small_i > small_j] == [target_i > target_j] (small[i] and
    target[i] are model i's scores at small and target scale); None below 2 models."""
    if len(small) != len(target):
        raise ValueError(f"decision_accuracy needs one target score per small score ({len(small)} vs {len(target)})")
    pairs = [(i, j) for i in range(len(small)) for j in range(i + 1, len(small))]
    if not pairs:
        return None
    return sum((small[i] > small[j]) == (target[i] > target[j]) for i, j in pairs) / len(pairs)


@dataclass(frozen=True)
class PopulationStats:
    task: str
    metric: str
    runs: int  # runs with at least one checkpoint of this task x metric
    last_n: int
    signal: float | None  # relative dispersion of the runs' mean-of-last-n scores
    noise: float | None  # mean of the runs' relative stds over their last n checkpoints
    snr: float | None
    decision_accuracy: float | None  # None without --small / --target, or below 2 complete pairs
    pairs: int  # model pairs behind decision_accuracy


def population_stats(task: str, metric: str, curves: dict[str, Curve], last_n: int = LAST_N,
                     small: list[str] | None = None, target: list[str] | None = None) -> PopulationStats:
    """Signal, noise, SNR (and decision accuracy when `small` / `target` name runs, paired by position) of one
    task x metric across runs: `curves` maps a run's name to its curve (step order; runs without the metric may be
    left out). Signal and noise are over the `small` runs when given (the paper's small-scale SNR: one scale, the
    one whose decisions are judged), else over all runs. The formulas: the module docstring."""
    population = {run: c for run, c in curves.items() if c and (not small or run in small)}
    tails = {run: [v for _, _, v, _ in c[-last_n:]] for run, c in population.items()}
    signal = relative_dispersion([sum(t) / len(t) for t in tails.values()])
    noises = [n for t in tails.values() if (n := relative_std(t)) is not None]
    noise = sum(noises) / len(noises) if noises else None
    snr = signal / noise if signal is not None and noise else None
    accuracy, pairs = None, 0
    if small and target:
        both = [(curves[s][-1][2], curves[t][-1][2]) for s, t in zip(small, target) if curves.get(s) and curves.get(t)]
        accuracy = decision_accuracy([s for s, _ in both], [t for _, t in both])
        pairs = len(both) * (len(both) - 1) // 2
    return PopulationStats(task, metric, len(tails), last_n, signal, noise, snr, accuracy, pairs)


# ---- along one run: trend and jitter ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CurveStats:
    task: str
    metric: str
    direction: str  # "improves" | "worsens" | "flat"
    checkpoints: int
    x: str  # "ln_tokens" | "ln_step": what the slope is measured against
    first: float
    last: float
    change: float
    slope: float | None
    trend: float | None
    jitter: float | None  # None with fewer than 3 points in the window
    stderr: float | None  # None when the metric records none
    noise: float | None
    trend_to_noise: float | None
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


def direction(metric: str, slope: float | None, slope_se: float | None) -> str:
    """"flat" when there is no slope or it is within two standard errors (`slope_se`) of zero; else "improves"
    when the slope goes the metric's better way (metric_kinds.lower_is_better), "worsens" otherwise."""
    if not slope or (slope_se is not None and abs(slope) <= 2 * slope_se):
        return "flat"
    return "improves" if (slope < 0) == lower_is_better(metric) else "worsens"


def curve_stats(task: str, metric: str, points: Curve, last_k: int = LAST_K) -> CurveStats | None:
    """Statistics of one curve (the module docstring, part 2): points are (step, consumed tokens or None, value,
    stderr or None), any order; None for fewer than two valued points."""
    pts = sorted((p for p in points if p[2] is not None and math.isfinite(p[2])), key=lambda p: p[0])
    if len(pts) < 2:
        return None
    use_tokens = all(t for _, t, _, _ in pts)
    x_name = "ln_tokens" if use_tokens else "ln_step"
    fit = [(math.log(t if use_tokens else s), v) for s, t, v, _ in pts if (t if use_tokens else s) > 0]
    xs, ys = [x for x, _ in fit], [y for _, y in fit]
    slope = line_fit(xs, ys)[1] if len(set(xs)) >= 2 else None
    trend = abs(slope) * (xs[-1] - xs[0]) if slope is not None else None
    window = fit[-last_k:]
    jitter = detrended_jitter([x for x, _ in window], [y for _, y in window])
    errs = [e for _, _, _, e in pts[-last_k:] if e is not None and math.isfinite(e)]
    stderr = sum(errs) / len(errs) if errs else None
    noise = jitter if jitter is not None else stderr
    ratio = trend / noise if trend is not None and noise else None
    slope_se = None  # the slope's standard error, from the noise
    if slope is not None and noise is not None:
        mx = sum(xs) / len(xs)
        slope_se = noise / math.sqrt(sum((x - mx) ** 2 for x in xs))
    tau = kendall_tau([float(s) for s, _, _, _ in pts], [v for _, _, v, _ in pts])
    return CurveStats(task, metric, direction(metric, slope, slope_se), len(pts), x_name, pts[0][2], pts[-1][2],
                      pts[-1][2] - pts[0][2], slope, trend, jitter, stderr, noise, ratio, tau)


def table_curves(rows: list[dict]) -> dict[tuple[str, str], Curve]:
    """{(task, metric): curve} of a sweep table (table.table_rows / read_table), in table order; error rows and
    rows without a value are left out."""
    curves: dict[tuple[str, str], Curve] = {}
    for r in rows:
        if not r.get("error") and r["value"] is not None:
            curves.setdefault((r["task"], r["metric"]), []).append(
                (r["step"], r["consumed_tokens"], r["value"], r["stderr"]))
    return {key: sorted(points, key=lambda p: p[0]) for key, points in curves.items()}


_ORDER = {"improves": 0, "flat": 1, "worsens": 2}


def ranked(rows: list[dict], last_k: int = LAST_K) -> list[CurveStats]:
    """Every task x metric of a sweep table (table.table_rows / read_table; error rows ignored): improving curves
    first, then flat, then worsening ones, each highest trend_to_noise first (None last, in table order)."""
    stats = [s for (task, metric), pts in table_curves(rows).items() if (s := curve_stats(task, metric, pts, last_k))]
    return sorted(stats, key=lambda s: (_ORDER[s.direction],
                                        -s.trend_to_noise if s.trend_to_noise is not None else math.inf))


def signal_rows(stats: list[CurveStats]) -> list[dict]:
    """One dict per curve with COLUMNS as keys (rank 1 = the improving curve that moved most against its noise)."""
    return [{"rank": k, **asdict(s)} for k, s in enumerate(stats, start=1)]
