"""The seeded fuzz of a checkpoint's tokenizer files and of an earlier run's output folder
(tests/surroundings_fuzz2.py), each surface in its own process under an address-space limit and a per-case alarm:
no case crashes (a traceback, a Rust panic escaping as something else than a NanoEvalError), hangs, allocates past
its limit or changes a byte outside the output folder; each is refused in one line, or loads / is handled as
nano_eval promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def fuzz(tmp_path: Path, surface: str, cases: int, seed: int) -> list[dict]:
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.surroundings_fuzz2", surface,
                           str(tmp_path / "work"), str(report), "--seed", str(seed), "--cases", str(cases)],
                          capture_output=True, text=True, timeout=1200, cwd=REPO,
                          env={**os.environ, "RUST_BACKTRACE": "0", "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stderr[-3000:]  # a segfault or abort names its case in the last stderr line
    got = json.loads(report.read_text())["cases"]
    assert len(got) == cases
    return got


@pytest.mark.parametrize("cases, seed", [(60, 0), pytest.param(400, 7, marks=pytest.mark.slow)])
def test_fuzzed_tokenizer_files_end_refused_or_load(tmp_path, cases, seed):
    """Byte flips, truncation and JSON edits of tokenizer.json, the chat template and generation_config.json,
    symlinks and FIFOs: refused in one line, or the same / other token ids and rendered prompts. A symlink out of
    the checkpoint is refused; one to a copy inside it loads the same."""
    got = fuzz(tmp_path, "tokenizer", cases, seed)
    bad = [c for c in got if c["outcome"] not in ("refused", "same", "different")]
    assert not bad, json.dumps(bad[:5], indent=1)
    assert {"refused", "same", "different"} <= {c["outcome"] for c in got}
    refused = [c["message"] for c in got if c["outcome"] == "refused"]
    assert all("\n" not in m and "Fix:" in m for m in refused), refused
    links = [c for c in got if c["mutation"].startswith("link")]
    assert links and all(c["outcome"] == ("refused" if c["mutation"].endswith("outside") else "same")
                         for c in links), json.dumps(links, indent=1)
    assert all(c["outcome"] == "refused" for c in got if c["mutation"].startswith("fifo"))


@pytest.mark.parametrize("cases, seed", [(60, 0), pytest.param(600, 7, marks=pytest.mark.slow)])
def test_fuzzed_output_folders_end_refused_or_handled(tmp_path, cases, seed):
    """Byte flips, truncation, JSON type changes, symlinks to a victim folder, FIFOs, sparse 8 GiB files and folders
    in place of the files of a sweep's output folder: each step of a restarted sweep (settings, running.json, the
    earlier results, writing new ones) refuses in one line keeping the refused file, or reads and writes correctly;
    the victim folder never changes."""
    got = fuzz(tmp_path, "outputs", cases, seed)
    bad = [c for c in got if c["outcome"] not in ("refused", "handled")]
    assert not bad, json.dumps(bad[:5], indent=1)
    assert {"refused", "handled"} <= {c["outcome"] for c in got}
    fifos = [c for c in got if c["mutation"].startswith("fifo")]
    assert fifos and all(c["outcome"] == "refused" and "FIFO" in c["message"] for c in fifos), fifos
