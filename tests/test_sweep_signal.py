"""The signal-to-noise report of a sweep (nano_eval.sweep.snr): on synthetic learning curves with a known slope
against ln(tokens) and known Gaussian checkpoint noise the estimates come back within tolerance, the ranking puts
the trending task first, and the report, sweep_signal.csv / .parquet and the W&B table carry it."""

import csv
import math
import random

import pytest

from nano_eval.sweep.snr import curve_stats, detrended_jitter, kendall_tau, ranked

SLOPE, NOISE, BASE_TOKENS, GROWTH = 0.05, 0.01, 1_000_000, 1.2


def _curve(task: str, slope: float, noise: float, n: int = 40, seed: int = 0, stderr: float | None = 0.02):
    """Table rows of one synthetic curve: value = 0.3 + slope * ln(tokens) + N(0, noise^2), tokens growing
    geometrically (x 1.2 per checkpoint), step = tokens / 1000."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        tokens = int(BASE_TOKENS * GROWTH ** i)
        rows.append({"checkpoint": f"c{i}", "step": tokens // 1000, "consumed_tokens": tokens, "task": task,
                     "metric": "acc", "value": 0.3 + slope * math.log(tokens) + rng.gauss(0, noise),
                     "stderr": stderr, "error": ""})
    return rows


def test_known_slope_and_noise_come_back():
    rows = _curve("t", SLOPE, NOISE)
    st = curve_stats("t", "acc", [(r["step"], r["consumed_tokens"], r["value"], r["stderr"]) for r in rows],
                     last_k=40)
    span = 39 * math.log(GROWTH)
    assert st.x == "ln_tokens" and st.checkpoints == 40
    assert st.slope == pytest.approx(SLOPE, rel=0.05)  # sd of the estimate: 1.5 %
    assert st.signal == pytest.approx(SLOPE * span, rel=0.05)
    assert st.jitter == pytest.approx(NOISE, rel=0.3)  # 38 degrees of freedom: sd 12 %
    assert st.noise == st.jitter and st.stderr == pytest.approx(0.02)
    assert st.snr == pytest.approx(SLOPE * span / NOISE, rel=0.35)
    assert st.kendall_tau > 0.8  # rising nearly everywhere: the step between checkpoints (0.009) ~ the noise
    assert st.change == pytest.approx(rows[-1]["value"] - rows[0]["value"])


def test_default_window_jitter_is_unbiased_over_many_runs():
    """The last 10 checkpoints (8 degrees of freedom) per curve, averaged over 200 synthetic runs: the variance
    estimate is unbiased, and the trend is removed (without detrending it would add (0.05 ln 1.2)^2 x 9.2)."""
    variances = []
    for seed in range(200):
        rows = _curve("t", SLOPE, NOISE, seed=seed)
        st = curve_stats("t", "acc", [(r["step"], r["consumed_tokens"], r["value"], r["stderr"]) for r in rows])
        variances.append(st.jitter ** 2)
    assert math.sqrt(sum(variances) / len(variances)) == pytest.approx(NOISE, rel=0.05)


def test_kendall_tau_and_detrending_by_hand():
    assert kendall_tau([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)  # one swapped pair of six
    assert kendall_tau([1, 2, 3], [5, 5, 5]) is None
    # tau-b with a tie in y: (C - D) / sqrt((C + D + Tx)(C + D + Ty)) = (2 - 0) / sqrt(2 * 3)
    assert kendall_tau([1, 2, 3], [1, 2, 2]) == pytest.approx(2 / math.sqrt(6))
    assert detrended_jitter([0, 1, 2], [0, 1, 2]) == 0.0  # a straight line has no jitter
    assert detrended_jitter([0, 1, 2], [0, 2, 0]) == pytest.approx(math.sqrt(8 / 3))  # residuals 2/3, -4/3, 2/3


def test_ranking_puts_the_trending_task_first_and_handles_short_curves():
    rows = _curve("flat", 0.0, NOISE, seed=1) + _curve("rising", SLOPE, NOISE, seed=2) + _curve(
        "falling_bpb", -2 * SLOPE, 4 * NOISE, seed=3)
    stats = ranked(rows)
    assert [s.task for s in stats] == ["rising", "falling_bpb", "flat"]
    assert stats[0].snr > 10 and stats[2].snr < 3
    assert stats[1].kendall_tau < -0.5 and stats[1].slope < 0  # lower is better: improves with tau near -1
    # two checkpoints: no jitter; the noise falls back to the metric's stderr
    two = ranked(_curve("short", SLOPE, NOISE, n=2))
    assert two[0].jitter is None and two[0].noise == 0.02 and two[0].snr is not None
    # tokens unknown: the slope is against ln(step)
    for r in rows:
        r["consumed_tokens"] = None
    assert ranked(rows)[0].x == "ln_step"
    assert ranked([{**rows[0], "error": "boom"}]) == []


def test_signal_table_and_report(tmp_path, monkeypatch):
    import sys
    from html.parser import HTMLParser

    from nano_eval.sweep.report import write_report
    from nano_eval.sweep.table import COLUMNS, CSV_NAME, write_signal_table

    rows = _curve("flat", 0.0, NOISE, n=12, seed=1) + _curve("rising", SLOPE, NOISE, n=12, seed=2)
    rows.sort(key=lambda r: r["step"])
    with (tmp_path / CSV_NAME).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    path = write_signal_table(rows, tmp_path)
    table = list(csv.DictReader(path.open()))
    assert [(r["rank"], r["task"]) for r in table] == [("1", "rising"), ("2", "flat")]
    assert float(table[0]["slope"]) == pytest.approx(SLOPE, rel=0.2)
    pq = pytest.importorskip("pyarrow.parquet")
    assert [r["task"] for r in pq.read_table(tmp_path / "sweep_signal.parquet").to_pylist()] == ["rising", "flat"]

    class Ranks(HTMLParser):
        ranks = []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "tr" and "data-rank" in a:
                self.ranks.append((a["data-rank"], a["data-task"], a["data-metric"]))

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # SVG curves: fast, and their stderr bands show
    page = write_report(tmp_path).read_text()
    assert page.count("<polygon") == 2  # one stderr band per curve
    parser = Ranks()
    parser.feed(page)
    assert parser.ranks == [("1", "rising", "acc"), ("2", "flat", "acc")]
    assert page.index("Which tasks carry signal") < page.index('<section data-task="rising">')
