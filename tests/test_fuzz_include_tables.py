"""The seeded fuzz of lm-eval include folders (their YAMLs, templates and Python: the task code and its metric
outputs) and of the sweep tables `nano_eval compare` reads (tests/surroundings_fuzz3.py), each surface in its own
process under an address-space limit and a per-case alarm: no case crashes, hangs, allocates past its limit, runs
or writes anything outside its folder, prints a raw escape or several error lines, or yields a non-finite number;
each is refused in one line, fails its task in one line while the others are scored, or is scored / compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def fuzz(tmp_path: Path, surface: str, cases: int, seed: int) -> dict:
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.surroundings_fuzz3", surface,
                           str(tmp_path / "work"), str(report), "--seed", str(seed), "--cases", str(cases)],
                          capture_output=True, text=True, timeout=1800, cwd=REPO,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-3000:]  # a segfault or abort names its case in the last stderr line
    got = json.loads(report.read_text())
    assert len(got["cases"]) == cases
    return got


@pytest.mark.parametrize("cases, seed", [(40, 0), pytest.param(300, 7, marks=pytest.mark.slow)])
def test_fuzzed_include_folders_end_refused_failed_or_scored(tmp_path, cases, seed):
    """Flips, truncation, FIFOs, folders, sparse files and symlinks in an include folder; Jinja bombs, a template
    reaching os.system, malformed generation_kwargs, includes and `!function`s leading out, alias bombs, deep
    nesting and escaped names in its YAMLs; process_results returning NaN, inf, text or calling sys.exit."""
    pytest.importorskip("lm_eval")
    got = fuzz(tmp_path, "include", cases, seed)
    assert got["control"] == ["scored", ""], got["control"]
    bad = [c for c in got["cases"] if c["outcome"] not in ("refused", "failed", "scored")]
    assert not bad, json.dumps(bad[:5], indent=1)
    assert {"refused", "failed", "scored"} <= {c["outcome"] for c in got["cases"]}
    for c in got["cases"]:  # a FIFO or a link out is refused by name; a link to a copy inside changes nothing
        if c["mutation"].startswith("fifo") or c["mutation"].startswith("link") and c["mutation"].endswith("outside"):
            assert c["outcome"] == "refused" and ("FIFO" in c["message"] or "leads outside" in c["message"]), c
        if c["mutation"].startswith("link") and c["mutation"].endswith("inside"):
            assert c["outcome"] == "scored", c


@pytest.mark.parametrize("cases, seed", [(80, 0), pytest.param(600, 7, marks=pytest.mark.slow)])
def test_fuzzed_comparison_tables_end_refused_or_compared(tmp_path, cases, seed):
    """Flips, truncation, hostile cells (inf, nan, 1e999, 10^300, text, 200k characters, escapes), rows and columns
    changed, CRLF, NUL, a BOM, FIFOs, links to a victim folder, sparse files and folders in place of the table."""
    got = fuzz(tmp_path, "tables", cases, seed)
    assert got["control"] == ["compared", ""], got["control"]
    bad = [c for c in got["cases"] if c["outcome"] not in ("refused", "compared")]
    assert not bad, json.dumps(bad[:5], indent=1)
    assert {"refused", "compared"} <= {c["outcome"] for c in got["cases"]}
    special = [c for c in got["cases"] if c["mutation"].endswith("in place of the table")]
    assert all(c["outcome"] == "refused" for c in special), special
    refused_values = [c for c in got["cases"] if any(f"-> '{v}'" in c["mutation"] for v in ("inf", "nan", "1e999"))
                      and (" value " in c["mutation"] or " stderr " in c["mutation"])]
    assert all(c["outcome"] == "refused" for c in refused_values), refused_values
