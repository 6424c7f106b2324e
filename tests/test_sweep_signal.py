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


# ---- comparing runs -----------------------------------------------------------------------------------------------

def _write_sweep(folder, rows):
    from nano_eval.sweep.table import COLUMNS, CSV_NAME

    folder.mkdir(parents=True)
    rows = sorted(rows, key=lambda r: (r["step"], r["task"]))
    with (folder / CSV_NAME).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def test_compare_flags_only_differences_larger_than_the_noise(tmp_path, monkeypatch, capsys):
    import sys

    from nano_eval.cli import main as run_main

    def shifted(rows, by):
        return [{**r, "value": r["value"] + by} for r in rows]

    # run b: 30 checkpoints where a has 40 (compared at b's last token count), 10 noise units better on "gap",
    # half a noise unit on "same"; a third run has only "same".
    a = _curve("gap", SLOPE, NOISE, seed=4) + _curve("same", SLOPE, NOISE, seed=5)
    b = shifted(_curve("gap", SLOPE, NOISE, n=30, seed=6), 10 * NOISE) + shifted(
        _curve("same", SLOPE, NOISE, n=30, seed=7), 0.5 * NOISE)
    _write_sweep(tmp_path / "a", a)
    _write_sweep(tmp_path / "b", b)
    _write_sweep(tmp_path / "c", _curve("same", SLOPE, NOISE, seed=8))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # SVG plots: fast
    assert run_main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"), "--output-dir",
                     str(tmp_path / "cmp"), "--labels", "base,wider,third"]) == 0
    out = capsys.readouterr().out
    assert "3 comparisons, 1 larger than 2 x noise" in out and "gap acc: wider" in out
    rows = {(r["task"], r["run"]): r for r in csv.DictReader((tmp_path / "cmp" / "compare.csv").open())}
    assert set(rows) == {("gap", "wider"), ("same", "wider"), ("same", "third")}
    gap = rows["gap", "wider"]
    assert gap["flagged"] == "True" and float(gap["difference"]) == pytest.approx(10 * NOISE, abs=4 * NOISE)
    assert float(gap["at"]) == int(BASE_TOKENS * GROWTH ** 29) and gap["x"] == "consumed_tokens"
    # the se of a line's end through 10 points is ~0.59 x the checkpoint noise; two runs in quadrature: ~0.84
    assert float(gap["noise"]) == pytest.approx(0.84 * NOISE, rel=0.5)
    assert rows["same", "wider"]["flagged"] == "False" and rows["same", "third"]["flagged"] == "False"
    page = (tmp_path / "cmp" / "index.html").read_text()
    assert page.count("<figure") == 2 and page.count("<polyline") == 2 + 3  # gap: 2 runs, same: 3 runs
    assert 'data-flagged="1" data-task="gap"' in page
    # bad input: one folder, a folder that is no sweep
    assert run_main(["compare", str(tmp_path / "a")]) == 2
    assert run_main(["compare", str(tmp_path / "a"), str(tmp_path)]) == 2
    assert f"{tmp_path} holds no sweep_results.csv" in capsys.readouterr().err


def test_interpolation_is_linear_in_log_tokens():
    from nano_eval.sweep.compare import interpolate

    assert interpolate([(10.0, 0.0), (1000.0, 1.0)], 100.0) == pytest.approx(0.5)
    assert interpolate([(10.0, 0.0), (1000.0, 1.0)], 1000.0) == pytest.approx(1.0)
    assert interpolate([(10.0, 0.0), (1000.0, 1.0)], 5000.0) is None


def test_compare_z_is_calibrated_when_runs_do_not_differ():
    """300 pairs of runs drawn alike: z has mean ~0 and sd ~1 (a t with 8 degrees of freedom: 1.15), so |z| > 2
    flags ~5-7 % of equal runs, not more."""
    import statistics

    from nano_eval.sweep.compare import differences

    def curves(rows):
        return {("t", "acc"): [(r["step"], r["consumed_tokens"], r["value"], r["stderr"]) for r in rows]}

    zs = [differences({"a": curves(_curve("t", SLOPE, NOISE, seed=s)),
                       "b": curves(_curve("t", SLOPE, NOISE, n=30, seed=1000 + s))})[0].z for s in range(300)]
    assert abs(statistics.mean(zs)) < 0.2 and 0.9 < statistics.pstdev(zs) < 1.2
    assert sum(abs(z) > 2 for z in zs) / len(zs) < 0.1
