"""Another run's sweep table is untrusted input (`nano_eval compare`, the sweep report), as are the names in it
(issue 44): a table with NaN, inf or 1e999, a step of 10^300, a negative stderr, a field past the CSV reader's limit
or a row with more fields than columns is refused as "not the table nano_eval wrote" (one line, exit code 2, naming
the file and line; it used to report -inf differences as significant or end in a traceback); 20,000 tasks x 2
checkpoints compare in seconds (plots are capped: a plot costs ~0.1 s); task, metric and run names with terminal
escapes, a forged error line or matplotlib's `$...$` print escaped on the terminal, in compare's page and in the
sweep report (no raw ESC byte), and draw.
"""

from __future__ import annotations

import csv
import io
import time
from pathlib import Path

import pytest

from nano_eval.cli import main
from nano_eval.sweep.table import COLUMNS, CSV_NAME

ESC = "\x1b[31mred\nnano_eval: error: forged $\\x^$"


def row(task: str, step: int, value, *, metric: str = "acc", stderr=0.01, tokens=None, checkpoint=None) -> dict:
    return {"checkpoint": checkpoint or f"step-{step}", "step": step, "consumed_tokens": tokens or step * 1000,
            "task": task, "metric": metric, "value": value, "stderr": stderr, "error": ""}


def write(folder: Path, rows: list[dict], text: str | None = None) -> Path:
    """A sweep output folder holding `rows` as nano_eval writes them (or the CSV `text` itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    if text is None:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        text = out.getvalue()
    (folder / CSV_NAME).write_text(text)
    return folder


def genuine(task: str = "t", shift: float = 0.0) -> list[dict]:
    return [row(task, s, 0.3 + 0.01 * s + shift) for s in (1, 2, 3)]


HEADER = ",".join(COLUMNS)
BAD = {
    "inf value": [row("t", 1, 0.3), row("t", 2, "inf")],
    "nan value": [row("t", 1, "nan"), row("t", 2, 0.4)],
    "1e999 value": [row("t", 1, 0.3), row("t", 2, "1e999")],
    "1e300 value": [row("t", 1, 0.3), row("t", 2, 1e300)],
    "huge step": [row("t", 1, 0.3), row("t", 10 ** 300, 0.4)],
    "negative step": [row("t", -1, 0.3), row("t", 2, 0.4)],
    "huge tokens": [row("t", 1, 0.3, tokens=10 ** 30), row("t", 2, 0.4)],
    "negative stderr": [row("t", 1, 0.3, stderr=-0.5), row("t", 2, 0.4)],
    "inf stderr": [row("t", 1, 0.3, stderr="inf"), row("t", 2, 0.4)],
    "text value": [row("t", 1, "high"), row("t", 2, 0.4)],
}
BAD_TEXT = {
    "missing columns": "task,metric,value\nt,acc,0.3\n",
    "extra fields": f"{HEADER}\nc,1,1000,t,acc,0.3,0.01,,x,y\n",
    "field past the csv limit": f"{HEADER}\nc,1,1000,{'t' * 200_000},acc,0.3,0.01,\n",
    "binary": "\x00\x01\x02garbage",
    "a step of many digits": f"{HEADER}\nc,{'9' * 5000},1000,t,acc,0.3,0.01,\n",
}


@pytest.mark.parametrize("name", list(BAD) + list(BAD_TEXT))
def test_compare_refuses_a_table_nano_eval_never_wrote(tmp_path, capsys, name):
    write(tmp_path / "a", genuine())
    write(tmp_path / "b", BAD.get(name, []), BAD_TEXT.get(name))
    start = time.monotonic()
    code = main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "cmp")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and time.monotonic() - start < 30, err
    assert err[0].startswith(f"nano_eval: error: {tmp_path / 'b' / CSV_NAME}: ") and "Fix:" in err[0], err
    assert "is not the table nano_eval wrote" in err[0] or "not UTF-8" in err[0], err
    assert not (tmp_path / "cmp").exists()


def test_a_genuine_comparison_still_flags_a_real_difference(tmp_path, capsys):
    """The refusals above do not touch genuine tables: the same comparison flags a shift of 10 stderrs, and not a
    shift of 0.1 (the check can fail)."""
    write(tmp_path / "a", genuine("t") + genuine("u"))
    write(tmp_path / "b", genuine("t", shift=0.1) + genuine("u", shift=0.001))
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert "2 comparisons, 1 larger than 2 x stderr" in out and "  t acc: b 0.4300 vs a 0.3300" in out


def test_20000_tasks_compare_in_seconds(tmp_path, capsys):
    """The issue's table (20,000 tasks x 2 checkpoints, two runs) did not finish in 90 s: one plot per task x metric.
    Now the tables hold every row and the page plots the largest differences only (compare.MAX_PLOTS)."""
    from nano_eval.sweep.compare import MAX_PLOTS

    n = 20_000
    write(tmp_path / "a", [row(f"task{i}", s, 0.5) for i in range(n) for s in (1, 2)])
    write(tmp_path / "b", [row(f"task{i}", s, 0.5 + (0.1 if i % 1000 == 0 else 0.0)) for i in range(n)
                           for s in (1, 2)])
    start = time.monotonic()
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "cmp")]) == 0
    elapsed = time.monotonic() - start
    assert f"{n} comparisons, 20 larger than 2 x stderr" in capsys.readouterr().out
    assert elapsed < 120, elapsed  # ~10 s on 2 busy cores, most of it the capped plots
    with (tmp_path / "cmp" / "compare.csv").open() as f:
        assert sum(1 for _ in f) == n + 1
    page = (tmp_path / "cmp" / "index.html").read_text()
    if pytest.importorskip("matplotlib"):
        assert page.count("<img") == MAX_PLOTS and f"the other {n - MAX_PLOTS} are in the tables" in page
        assert all(f'<figure data-task="task{i}"' in page for i in range(0, n, 1000))  # the flagged ones first


def test_names_from_other_runs_print_escaped_and_draw(tmp_path, capsys):
    write(tmp_path / "a", genuine(ESC) + [row("t", s, 0.3, metric=ESC) for s in (1, 2)])
    write(tmp_path / "b", genuine(ESC, shift=0.5) + [row("t", s, 0.3, metric=ESC) for s in (1, 2)])
    code = main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--output-dir", str(tmp_path / "cmp"),
                 "--labels", f"base,{ESC}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "\x1b" not in captured.out + captured.err
    assert not any(line.startswith("nano_eval: error") for line in captured.out.splitlines())
    assert "\\x1b[31mred\\nnano_eval: error: forged" in captured.out
    page = (tmp_path / "cmp" / "index.html").read_text()
    assert "\x1b" not in page and "\\x1b[31mred\\nnano_eval: error: forged $\\x^$" in page
    if pytest.importorskip("matplotlib"):
        assert page.count("<img") == 2  # `$\x^$` is no mathtext error: drawn as text


def test_the_sweep_report_escapes_names(tmp_path):
    from nano_eval.sweep.report import write_report

    out = write(tmp_path / "sweep", genuine(ESC) + [row("t", s, 0.3, metric=ESC, checkpoint=ESC) for s in (1, 2)])
    page = write_report(out).read_text()
    assert "\x1b" not in page and "\\x1b[31mred" in page


def test_a_sweep_never_writes_a_value_compare_would_refuse(tmp_path):
    """Its own table: a results file holding inf, 1e300 or a negative stderr is written as an empty value, so the
    sweep's table always reads back (and compares)."""
    from nano_eval.sweep.table import _num, read_table

    assert [_num(v) for v in (float("inf"), float("nan"), 1e300, -1e300, 0.5)] == [None, None, None, None, 0.5]
    assert _num(-0.1, minimum=0.0) is None
    write(tmp_path / "s", [row("t", 1, _num(float("inf")) or "", stderr=_num(-1.0, minimum=0.0) or "")])
    assert read_table(tmp_path / "s")[0]["value"] is None
