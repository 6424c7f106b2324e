"""Signal and noise of sweeps (nano_eval.sweep.snr, compare.py, report.py).

Across runs, Heineman et al. (2025, arXiv 2508.13144): signal, noise, SNR and decision accuracy on hand-computed
examples and on a synthetic population with known signal and noise. Along one run: on synthetic learning curves
with a known slope against ln(tokens) and known Gaussian checkpoint noise the trend and jitter come back within
tolerance, improving curves rank first and worsening ones last, and the report, sweep_signal.csv / .parquet carry
it. `nano_eval compare` reads runs at observed (or interpolated) checkpoints only, so bounded metrics stay in range.
"""

import csv
import math
import random

import pytest

from nano_eval.sweep.snr import (curve_stats, decision_accuracy, detrended_jitter, kendall_tau, population_stats,
                                 ranked, relative_dispersion, relative_std)

SLOPE, NOISE, BASE_TOKENS, GROWTH = 0.05, 0.01, 1_000_000, 1.2


def _curve(task: str, slope: float, noise: float, n: int = 40, seed: int = 0, stderr: float | None = 0.02,
           metric: str = "acc", base: float = 0.3):
    """Table rows of one synthetic curve: value = base + slope * ln(tokens / 1e6) + N(0, noise^2) (in [0, 1] for
    the slopes used), tokens growing geometrically (x 1.2 per checkpoint), step = tokens / 1000."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        tokens = int(BASE_TOKENS * GROWTH ** i)
        rows.append({"checkpoint": f"c{i}", "step": tokens // 1000, "consumed_tokens": tokens, "task": task,
                     "metric": metric, "value": base + slope * math.log(tokens / BASE_TOKENS) + rng.gauss(0, noise),
                     "stderr": stderr, "error": ""})
    return rows


# ---- across runs: Heineman et al. 2025 ------------------------------------------------------------------------------

def test_paper_formulas_by_hand():
    # signal: max |m_j - m_k| / mean(m) = (0.6 - 0.4) / 0.5
    assert relative_dispersion([0.4, 0.5, 0.6]) == pytest.approx(0.4)
    assert relative_dispersion([0.5]) is None and relative_dispersion([1.0, -1.0]) is None  # mean 0
    assert relative_dispersion([-2.0, -4.0]) == pytest.approx(2 / 3)  # |mean|: a positive ratio
    # noise of one run: std (ddof 0) / mean: values 0.9, 1.1 -> std 0.1, mean 1.0
    assert relative_std([0.9, 1.1]) == pytest.approx(0.1)
    assert relative_std([2.0, 4.0, 6.0]) == pytest.approx(math.sqrt(8 / 3) / 4)
    assert relative_std([1.0]) is None
    # decision accuracy: pairs (0,1) (0,2) (1,2); target swaps models 1 and 2 -> 2 of 3 pairs agree
    assert decision_accuracy([0.1, 0.2, 0.3], [1.0, 3.0, 2.0]) == pytest.approx(2 / 3)
    assert decision_accuracy([0.1, 0.2, 0.3], [3.0, 2.0, 1.0]) == 0.0  # every pair reversed
    assert decision_accuracy([0.3, 0.1], [0.5, 0.2]) == 1.0 and decision_accuracy([1.0], [2.0]) is None
    with pytest.raises(ValueError):
        decision_accuracy([1.0, 2.0], [1.0])


def _run(values: list[float], stderr: float | None = 0.01) -> list:
    """A curve (step, tokens, value, stderr) with the given values at steps 1..n, tokens 1000 x 2^i."""
    return [(i + 1, 1000 * 2 ** i, v, stderr) for i, v in enumerate(values)]


def test_population_stats_by_hand():
    # run a's last 3: 0.9, 1.1, 1.0 (mean 1.0, std sqrt(0.02/3)); run b's last 3: 1.9, 2.1, 2.0 (mean 2.0)
    curves = {"a": _run([0.1, 0.9, 1.1, 1.0]), "b": _run([0.5, 1.9, 2.1, 2.0])}
    st = population_stats("t", "acc", curves, last_n=3)
    sd = math.sqrt(0.02 / 3)
    assert st.runs == 2 and st.last_n == 3
    assert st.signal == pytest.approx((2.0 - 1.0) / 1.5)
    assert st.noise == pytest.approx((sd / 1.0 + sd / 2.0) / 2)
    assert st.snr == pytest.approx(st.signal / st.noise)
    assert st.decision_accuracy is None and st.pairs == 0


def test_synthetic_population_has_the_known_snr_and_decision_accuracy():
    """Six models whose last 6 checkpoints alternate m_j +- d_j (so the mean of the last 6 is m_j and their std,
    ddof 0, is d_j exactly), the earlier checkpoints random: signal, noise and SNR are known in closed form and
    come back within 1 %. Decision accuracy: the small-scale runs' final scores order the models as the target
    runs do except two adjacent swaps -> 13 of 15 pairs agree."""
    rng = random.Random(0)
    means = [0.30, 0.34, 0.38, 0.42, 0.46, 0.50]
    wiggle = [0.004, 0.006, 0.005, 0.008, 0.003, 0.007]
    runs = {}
    for j, (m, d) in enumerate(zip(means, wiggle)):
        tail = [m + d if i % 2 else m - d for i in range(6)]
        runs[f"small{j}"] = _run([rng.uniform(0, 1) for _ in range(10)] + tail)
    signal = (0.50 - 0.30) / (sum(means) / 6)
    noise = sum(d / m for m, d in zip(means, wiggle)) / 6
    final_small = [runs[f"small{j}"][-1][2] for j in range(6)]  # m_j + d_j: same order as means
    target_order = [0, 2, 1, 3, 5, 4]  # models 1 and 2, and 4 and 5, swap places at target scale
    for j in range(6):
        runs[f"target{j}"] = _run([0.5, 0.6 + 0.01 * target_order.index(j)])
    small, target = [f"small{j}" for j in range(6)], [f"target{j}" for j in range(6)]
    st = population_stats("t", "acc", {k: v for k, v in runs.items() if k in small}, last_n=6)
    assert st.signal == pytest.approx(signal, rel=0.01)
    assert st.noise == pytest.approx(noise, rel=0.01)
    assert st.snr == pytest.approx(signal / noise, rel=0.01)
    assert final_small == sorted(final_small)
    with_da = population_stats("t", "acc", runs, last_n=6, small=small, target=target)
    assert with_da.decision_accuracy == pytest.approx(13 / 15, rel=0.01) and with_da.pairs == 15
    assert (with_da.signal, with_da.noise, with_da.runs) == (st.signal, st.noise, 6)  # over the small runs only


def test_synthetic_gaussian_population_matches_the_formulas():
    """Ten runs, Gaussian checkpoint noise sigma around final scores spread evenly over [0.3, 0.5], last_n = 200:
    noise ~ mean_j sigma / m_j and signal = 0.2 / 0.4 within a few %, and the computed numbers equal the paper's
    formulas (numpy) within 1e-9."""
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)
    sigma, means = 0.01, np.linspace(0.3, 0.5, 10)
    tails = [m + rng.normal(0, sigma, 200) for m in means]
    curves = {f"r{j}": _run(list(t)) for j, t in enumerate(tails)}
    st = population_stats("t", "acc", curves, last_n=200)
    m = np.array([t.mean() for t in tails])
    assert st.signal == pytest.approx(np.max(np.abs(m[:, None] - m[None, :])) / m.mean(), rel=1e-9)
    assert st.noise == pytest.approx(np.mean([t.std() / t.mean() for t in tails]), rel=1e-9)
    assert st.signal == pytest.approx(0.5, rel=0.03)
    assert st.noise == pytest.approx(np.mean(sigma / means), rel=0.03)


# ---- along one run: trend and jitter ------------------------------------------------------------------------------

def test_known_slope_and_noise_come_back():
    rows = _curve("t", SLOPE, NOISE)
    st = curve_stats("t", "acc", [(r["step"], r["consumed_tokens"], r["value"], r["stderr"]) for r in rows],
                     last_k=40)
    span = 39 * math.log(GROWTH)
    assert st.x == "ln_tokens" and st.checkpoints == 40 and st.direction == "improves"
    assert st.slope == pytest.approx(SLOPE, rel=0.05)  # sd of the estimate: 1.5 %
    assert st.trend == pytest.approx(SLOPE * span, rel=0.05)
    assert st.jitter == pytest.approx(NOISE, rel=0.3)  # 38 degrees of freedom: sd 12 %
    assert st.noise == st.jitter and st.stderr == pytest.approx(0.02)
    assert st.trend_to_noise == pytest.approx(SLOPE * span / NOISE, rel=0.35)
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


def test_ranking_is_direction_aware():
    """Improving curves rank first, flat next, worsening last, whatever their trend / noise: accuracy falling and
    bits_per_byte rising (the issue's arithmetic_ppl, 0.347 -> 0.397) are never ranked as signal."""
    rows = (_curve("flat", 0.0, NOISE, seed=1) + _curve("rising", SLOPE, NOISE, seed=2)
            + _curve("falling_bpb", -2 * SLOPE, 4 * NOISE, seed=3, metric="bits_per_byte", base=0.9)
            + _curve("rising_bpb", 3 * SLOPE, NOISE, seed=4, metric="bits_per_byte")
            + _curve("falling_acc", -2 * SLOPE, NOISE, seed=5, base=0.9))
    stats = ranked(rows)
    assert [(s.task, s.direction) for s in stats] == [
        ("rising", "improves"), ("falling_bpb", "improves"), ("flat", "flat"), ("rising_bpb", "worsens"),
        ("falling_acc", "worsens")]
    assert stats[0].trend_to_noise > 10 and stats[2].trend_to_noise < 1
    assert stats[3].trend_to_noise > stats[0].trend_to_noise  # moved most, but the wrong way
    assert stats[1].kendall_tau < -0.5 and stats[1].slope < 0  # lower is better: improves with tau near -1
    # two checkpoints: no jitter; the noise falls back to the metric's stderr
    two = ranked(_curve("short", SLOPE, NOISE, n=2))
    assert two[0].jitter is None and two[0].noise == 0.02 and two[0].trend_to_noise is not None
    # tokens unknown: the slope is against ln(step)
    for r in rows:
        r["consumed_tokens"] = None
    assert ranked(rows)[0].x == "ln_step"
    assert ranked([{**rows[0], "error": "boom"}]) == []


def test_metric_kinds_cover_the_registry():
    from nano_eval.metrics.registry import METRICS
    from nano_eval.sweep.metric_kinds import bounded, lower_is_better

    for name, metric in METRICS.items():
        assert lower_is_better(name) == (not metric.higher_is_better), name
    for name in ("acc", "acc_norm", "prob_norm_gold", "exact_match", "f1_eng", "pass@1", "em", "maj@4"):
        assert bounded(name), name
    for name in ("bits_per_byte", "word_perplexity", "bleu", "ppl"):
        assert not bounded(name), name


def test_signal_table_and_report_without_matplotlib(tmp_path, monkeypatch, capsys):
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
    assert [(r["rank"], r["task"], r["direction"]) for r in table] == [("1", "rising", "improves"),
                                                                       ("2", "flat", "flat")]
    assert float(table[0]["slope"]) == pytest.approx(SLOPE, rel=0.2)
    assert "snr" not in table[0] and float(table[0]["trend_to_noise"]) > 1
    pq = pytest.importorskip("pyarrow.parquet")
    assert [r["task"] for r in pq.read_table(tmp_path / "sweep_signal.parquet").to_pylist()] == ["rising", "flat"]

    class Ranks(HTMLParser):
        ranks = []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if tag == "tr" and "data-rank" in a:
                self.ranks.append((a["data-rank"], a["data-task"], a["data-metric"], a["data-direction"]))

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # `import matplotlib.figure` fails, as if absent
    page = write_report(tmp_path).read_text()
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "pip install -e '.[report]'" in err and "the sweep report" in err
    assert "<img" not in page and "<svg" not in page and not list((tmp_path / "report").glob("*.png"))
    parser = Ranks()
    parser.feed(page)
    assert parser.ranks == [("1", "rising", "acc", "improves"), ("2", "flat", "acc", "flat")]
    assert page.index("Which tasks moved") < page.index('<section data-task="rising">')
    assert "1/mean" not in page


# ---- comparing runs -----------------------------------------------------------------------------------------------

def _write_sweep(folder, rows):
    from nano_eval.sweep.table import COLUMNS, CSV_NAME

    folder.mkdir(parents=True)
    rows = sorted(rows, key=lambda r: (r["step"], r["task"]))
    with (folder / CSV_NAME).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def test_compare_flags_only_differences_larger_than_the_stderr(tmp_path, capsys):
    from nano_eval.cli import main as run_main

    def shifted(rows, by):
        return [{**r, "value": r["value"] + by} for r in rows]

    # run b: 30 checkpoints where a has 40 (compared at b's last token count, a checkpoint of both), 10 noise
    # units better on "gap" (z = 0.1 / sqrt(2 x 0.02^2) ~ 3.5), half a unit on "same"; a third run has only "same".
    a = _curve("gap", SLOPE, NOISE, seed=4) + _curve("same", SLOPE, NOISE, seed=5)
    b = shifted(_curve("gap", SLOPE, NOISE, n=30, seed=6), 10 * NOISE) + shifted(
        _curve("same", SLOPE, NOISE, n=30, seed=7), 0.5 * NOISE)
    _write_sweep(tmp_path / "a", a)
    _write_sweep(tmp_path / "b", b)
    _write_sweep(tmp_path / "c", _curve("same", SLOPE, NOISE, seed=8))
    assert run_main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"), "--output-dir",
                     str(tmp_path / "cmp"), "--labels", "base,wider,third"]) == 0
    out = capsys.readouterr().out
    assert "3 comparisons, 1 larger than 2 x stderr" in out and "gap acc: wider" in out
    assert "signal and noise across runs (the last 5 checkpoints of each run" in out and "gap acc: signal" in out
    rows = {(r["task"], r["run"]): r for r in csv.DictReader((tmp_path / "cmp" / "compare.csv").open())}
    assert set(rows) == {("gap", "wider"), ("same", "wider"), ("same", "third")}
    gap = rows["gap", "wider"]
    assert gap["flagged"] == "True" and float(gap["difference"]) == pytest.approx(10 * NOISE, abs=4 * NOISE)
    assert float(gap["at"]) == int(BASE_TOKENS * GROWTH ** 29) and gap["x"] == "consumed_tokens"
    # observed checkpoints of both runs: the recorded values and stderrs
    assert float(gap["value"]) == pytest.approx(b[29]["value"]) and float(gap["baseline_value"]) == pytest.approx(
        a[29]["value"])
    assert float(gap["noise"]) == pytest.approx(math.sqrt(2) * 0.02)
    assert rows["same", "wider"]["flagged"] == "False" and rows["same", "third"]["flagged"] == "False"
    signal = {r["task"]: r for r in csv.DictReader((tmp_path / "cmp" / "compare_signal.csv").open())}
    assert signal["gap"]["runs"] == "2" and signal["same"]["runs"] == "3" and signal["gap"]["last_n"] == "5"
    assert float(signal["gap"]["snr"]) == pytest.approx(float(signal["gap"]["signal"]) / float(
        signal["gap"]["noise"]))
    page = (tmp_path / "cmp" / "index.html").read_text()
    if pytest.importorskip("matplotlib"):
        assert page.count("<figure") == 2 and page.count("<img") == 2 and "<svg" not in page
    assert 'data-flagged="1" data-task="gap"' in page and page.count('data-population="1"') == 2
    # bad input: one folder, a folder that is no sweep, unknown or unpaired --small / --target
    assert run_main(["compare", str(tmp_path / "a")]) == 2
    assert run_main(["compare", str(tmp_path / "a"), str(tmp_path)]) == 2
    assert f"{tmp_path} holds no sweep_results.csv" in capsys.readouterr().err
    assert run_main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "x"),
                     "--small", "a,b", "--target", "b"]) == 2
    assert run_main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "x"),
                     "--small", "a,z", "--target", "b,a"]) == 2
    assert "name runs that are not compared: ['z']" in capsys.readouterr().err


def test_compare_decision_accuracy_from_the_cli(tmp_path, capsys, monkeypatch):
    import sys

    from nano_eval.cli import main as run_main

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    # three models at small (s*) and target (t*) scale; the target swaps models 1 and 2: 2 of 3 pairs agree
    finals = {"s0": 0.30, "s1": 0.40, "s2": 0.50, "t0": 0.50, "t1": 0.70, "t2": 0.60}
    for name, final in finals.items():
        rows = _curve("t", 0.0, 0.0, n=6)
        rows[-1]["value"] = final
        _write_sweep(tmp_path / name, rows)
    assert run_main(["compare", *(str(tmp_path / n) for n in finals), "--output-dir", str(tmp_path / "cmp"),
                     "--small", "s0,s1,s2", "--target", "t0,t1,t2", "--last-n", "3"]) == 0
    captured = capsys.readouterr()
    assert "decision accuracy 0.67 (3 pairs)" in captured.out
    assert captured.err.count("pip install -e '.[report]'") == 1
    [row] = list(csv.DictReader((tmp_path / "cmp" / "compare_signal.csv").open()))
    assert float(row["decision_accuracy"]) == pytest.approx(2 / 3) and row["pairs"] == "3" and row["last_n"] == "3"
    # over the --small runs: last 3 = 0.3, 0.3, final -> m = 0.3 + (0, 0.1, 0.2) / 3, signal = (0.2 / 3) / (1 / 3)
    assert row["runs"] == "3" and float(row["signal"]) == pytest.approx(0.2)


def test_compare_never_leaves_a_bounded_metric_or_the_observed_range(tmp_path, capsys, monkeypatch):
    """Two runs that sit at 1.00 with noise (the issue: a line through the last checkpoints read at x* gave
    accuracy 1.0202 and bits_per_byte -0.078): every value compare writes or prints is one the run recorded or
    lies between two it recorded, so accuracies and probabilities stay in [0, 1]."""
    import re
    import sys

    from nano_eval.cli import main as run_main

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    acc_a = [0.90, 0.93, 0.96, 0.99, 1.0, 0.99, 1.0, 1.0]  # the old line fit read this at 1.019
    acc_b = [0.91, 0.94, 0.97, 0.99, 1.0, 1.0, 0.99, 1.0, 1.0, 0.98]
    bpb_a = [0.40, 0.30, 0.20, 0.10, 0.02, 0.03, 0.02, 0.02]
    bpb_b = [0.41, 0.31, 0.21, 0.11, 0.03, 0.02, 0.03, 0.02, 0.02, 0.03]

    def rows(values, metric, tokens_per_step):
        return [{"checkpoint": f"c{i}", "step": i + 1, "consumed_tokens": tokens_per_step * 2 ** i, "task": "t",
                 "metric": metric, "value": v, "stderr": 0.01, "error": ""} for i, v in enumerate(values)]

    # b's checkpoints sit between a's (x 1.5 the tokens): b is read by interpolation, a at its last checkpoint
    _write_sweep(tmp_path / "a", rows(acc_a, "acc", 3000) + rows(bpb_a, "bits_per_byte", 3000))
    _write_sweep(tmp_path / "b", rows(acc_b, "acc", 2000) + rows(bpb_b, "bits_per_byte", 2000))
    assert run_main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "cmp"),
                     "--threshold", "0.1"]) == 0
    out = capsys.readouterr().out
    found = {r["metric"]: r for r in csv.DictReader((tmp_path / "cmp" / "compare.csv").open())}
    acc, bpb = found["acc"], found["bits_per_byte"]
    assert float(acc["at"]) == 3000 * 2 ** 7 and float(acc["baseline_value"]) == 1.0
    assert 0.98 <= float(acc["value"]) <= 1.0  # between b's checkpoints around x*: 1.0 and 0.98
    assert 0.02 <= float(bpb["value"]) <= 0.03 and float(bpb["baseline_value"]) == 0.02
    printed = [float(v) for v in re.findall(r"\b[01]\.\d{4}\b", out)]
    assert printed and all(0.0 <= v <= 1.0 for v in printed)


def test_interpolation_is_linear_in_log_tokens_and_never_extrapolates():
    from nano_eval.sweep.compare import interpolate, value_at

    pts = [(10.0, 0.0, 0.1), (1000.0, 1.0, 0.3)]
    assert interpolate(pts, 100.0) == pytest.approx((0.5, 0.2))
    assert interpolate(pts, 1000.0) == (1.0, 0.3) and interpolate(pts, 10.0) == (0.0, 0.1)
    assert interpolate(pts, 5000.0) is None and interpolate(pts, 5.0) is None
    assert interpolate([(0.0, 0.0, None), (10.0, 1.0, 0.1)], 5.0) == pytest.approx((0.5, None))  # step 0: in x
    assert value_at([(1, 10, 0.5, None), (2, 1000, 1.0, 0.1)], 100.0, True) == pytest.approx((0.75, None))


def test_compare_z_is_calibrated_when_runs_do_not_differ():
    """300 pairs of runs drawn alike, recorded stderr = the checkpoint noise: z has mean ~0 and sd ~1, so |z| > 2
    flags ~5 % of equal runs, not more."""
    import statistics

    from nano_eval.sweep.compare import differences

    def curves(rows):
        return {("t", "acc"): [(r["step"], r["consumed_tokens"], r["value"], r["stderr"]) for r in rows]}

    zs = [differences({"a": curves(_curve("t", SLOPE, NOISE, seed=s, stderr=NOISE)),
                       "b": curves(_curve("t", SLOPE, NOISE, n=30, seed=1000 + s, stderr=NOISE))})[0].z
          for s in range(300)]
    assert abs(statistics.mean(zs)) < 0.2 and 0.9 < statistics.pstdev(zs) < 1.1
    assert sum(abs(z) > 2 for z in zs) / len(zs) < 0.1
