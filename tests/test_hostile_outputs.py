"""Hostile output folders (issue 35, items 1 and 4): everything nano_eval reads or writes outside a checkpoint goes
through nano_eval.local_files, so another user's entries in an output folder never run code, never make nano_eval
write or delete outside the folder, never hang it, never end in a traceback, and never lose results.

Each case plants one entry (a symlink to a victim folder, a FIFO, a sparse 8 GiB file, a malformed state file, a
forged job record with a pickle beside it) and ends either refused (exit 2, one `nano_eval: error:` line naming the
entry and the fix, within 60 s) or handled (re-scored with a warning, a failed checkpoint while the sweep goes on,
an evaluation failure the hook's fail_soft absorbs); the victim folder is compared byte for byte afterwards.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nano_eval.cli import main
from tests.fuzz_case import snapshot, within

TASK = "demo|arithmetic|0"
DETAILS = "demo_arithmetic_0.jsonl"


# ---- helpers ------------------------------------------------------------------------------------------------------

def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("nano_eval: error:")]


def refused(capsys, argv: list[str], *expected: str) -> str:
    """The command ends with exit code 2 and exactly one error line holding every `expected`, within 60 s."""
    code = within(60, main, argv)
    err = capsys.readouterr().err
    lines = errors(err)
    assert code == 2 and len(lines) == 1, (code, err[-3000:])
    assert "Fix:" in lines[0] and all(e in lines[0] for e in expected), lines[0]
    assert "Traceback" not in err, err[-3000:]
    return lines[0]


@pytest.fixture
def victim(tmp_path):
    """A folder outside every output folder, with a details-like file and another one: must stay as it is."""
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "precious.jsonl").write_text('{"mine": 1}\n')
    (folder / "index.html").write_text("mine")
    before = snapshot(folder)
    yield folder
    assert snapshot(folder) == before, "something outside the output folder was written or deleted"


def eval_args(ckpt, out: Path, *extra: str) -> list[str]:
    return ["--checkpoint", str(ckpt), "--tasks", TASK, "--max-samples", "2", "--output-dir", str(out), *extra]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, toy_checkpoint):
    """A training run of two HF Trainer checkpoints (copies of the toy checkpoint)."""
    run = tmp_path_factory.mktemp("hostile_run") / "run"
    for step in (8, 16):
        shutil.copytree(toy_checkpoint, run / f"checkpoint-{step}")
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return run


def sweep_args(run: Path, out: Path, *extra: str) -> list[str]:
    return ["sweep", str(run), "--tasks", TASK, "--max-samples", "2", "--settle-s", "0", "--output-dir", str(out),
            *extra]


# ---- nano_eval eval -----------------------------------------------------------------------------------------------

def test_eval_never_writes_or_deletes_through_a_symlinked_details_folder(capsys, tmp_path, toy_checkpoint, victim):
    out = tmp_path / "out"
    out.mkdir()
    (out / "details").symlink_to(victim)
    refused(capsys, eval_args(toy_checkpoint, out), "details", "symlink")
    assert not (out / "results.json").exists()


@pytest.mark.parametrize("entry", ["results.json", f"details/{DETAILS}"])
def test_eval_refuses_a_fifo_output_file_instead_of_hanging(capsys, tmp_path, toy_checkpoint, entry):
    out = tmp_path / "out"
    (out / "details").mkdir(parents=True)
    os.mkfifo(out / entry)
    refused(capsys, eval_args(toy_checkpoint, out), entry.split("/")[-1], "FIFO")


def test_a_bad_details_entry_is_refused_before_scoring_and_the_old_results_stay(capsys, tmp_path, toy_checkpoint):
    """Item 4: every output path of this run is checked before scoring; the old results are not deleted first."""
    out = tmp_path / "out"
    assert main(eval_args(toy_checkpoint, out)) == 0
    old = (out / "results.json").read_bytes()
    (out / "details" / DETAILS).unlink()
    (out / "details" / DETAILS).mkdir()  # a folder where this run's details file goes
    capsys.readouterr()
    refused(capsys, eval_args(toy_checkpoint, out), DETAILS, "is a folder")
    assert (out / "results.json").read_bytes() == old


def test_a_sparse_8_gib_results_file_is_replaced_not_read(tmp_path, toy_checkpoint):
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "results.json", "wb") as f:
        f.truncate(8 << 30)
    assert within(60, main, eval_args(toy_checkpoint, out)) == 0
    assert json.loads((out / "results.json").read_text())["results"][TASK]


def test_a_failure_while_writing_keeps_the_old_results_and_details(tmp_path, toy_checkpoint, monkeypatch):
    """The new files are written to temporary names first: a write that fails (full disk) leaves the old
    evaluation whole, and no temporary file behind."""
    import nano_eval.local_files as local_files

    out = tmp_path / "out"
    assert main(eval_args(toy_checkpoint, out, "--tasks", f"{TASK},demo|arithmetic_ppl|0")) == 0
    before = snapshot(out)
    real, calls = local_files.write_temporary, []

    def full_disk(path, data, **kw):
        calls.append(path)
        if Path(path).name == "results.json":
            raise OSError(28, "No space left on device")
        return real(path, data, **kw)

    monkeypatch.setattr(local_files, "write_temporary", full_disk)
    assert main(eval_args(toy_checkpoint, out, "--tasks", "demo|arithmetic|3")) != 0
    assert [Path(c).name for c in calls] == ["demo_arithmetic_3.jsonl", "results.json"]
    assert snapshot(out) == before


# ---- nano_eval sweep ----------------------------------------------------------------------------------------------

def test_sweep_never_writes_a_report_through_a_symlink(capsys, tmp_path, run_dir, victim):
    out = tmp_path / "out"
    out.mkdir()
    (out / "report").symlink_to(victim)
    refused(capsys, sweep_args(run_dir, out), "report", "symlink")
    assert not (out / "sweep_settings.json").exists()  # refused before the folder was claimed


@pytest.mark.parametrize("entry", ["sweep_settings.json", "sweep_results.csv", ".nano_eval_sweep.lock"])
def test_sweep_refuses_fifo_state_files_instead_of_hanging(capsys, tmp_path, run_dir, entry):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / entry)
    refused(capsys, sweep_args(run_dir, out, "--no-report"), entry, "FIFO")


def test_sweep_never_truncates_what_a_symlinked_lock_file_points_to(capsys, tmp_path, run_dir, victim):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".nano_eval_sweep.lock").symlink_to(victim / "precious.jsonl")
    refused(capsys, sweep_args(run_dir, out, "--no-report"), ".nano_eval_sweep.lock", "symlink")


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '"x"'])
def test_a_malformed_settings_file_is_refused_naming_it(capsys, tmp_path, run_dir, content):
    out = tmp_path / "out"
    out.mkdir()
    (out / "sweep_settings.json").write_text(content)
    refused(capsys, sweep_args(run_dir, out, "--no-report"), "sweep_settings.json", "delete it")
    assert (out / "sweep_settings.json").read_text() == content  # never guessed at or overwritten


def test_bad_checkpoint_outputs_are_rescored_or_fail_that_checkpoint_only(capsys, tmp_path, run_dir, victim):
    """Earlier results that cannot be used are scored again (a warning names the file); a checkpoint whose
    output folder is a symlink, or holds one or a FIFO where results go, fails without loading and the sweep goes
    on (exit 1, the table's error column names the entry)."""
    from nano_eval.sweep.table import read_table

    out = tmp_path / "out"
    assert main(sweep_args(run_dir, out, "--no-report")) == 0
    capsys.readouterr()
    (out / "checkpoint-8" / "results.json").write_text('{"sweep": {"evaluation_identity": 1}, "results": 3}')
    with open(out / "checkpoint-16" / "results.json", "wb") as f:
        f.truncate(8 << 30)
    assert within(60, main, sweep_args(run_dir, out, "--no-report")) == 0
    err = capsys.readouterr().err
    for name in ("checkpoint-8", "checkpoint-16"):
        assert f"{name}/results.json" in err and "scored again" in err, err
        assert json.loads((out / name / "results.json").read_text())["results"][TASK]
    assert "Traceback" not in err

    shutil.rmtree(out / "checkpoint-8")
    (out / "checkpoint-8").symlink_to(victim)
    shutil.rmtree(out / "checkpoint-16" / "details")
    (out / "checkpoint-16" / "details").symlink_to(victim)
    (out / "checkpoint-16" / "results.json").unlink()
    assert within(60, main, sweep_args(run_dir, out, "--no-report")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    rows = read_table(out)
    failed = {r["step"]: r["error"] for r in rows if r["error"]}
    assert set(failed) == {8, 16} and "checkpoint-8" in failed[8] and "details" in failed[16], failed
    assert all("symlink" in why for why in failed.values()), failed

    (out / "checkpoint-8").unlink()
    (out / "checkpoint-8").mkdir()
    os.mkfifo(out / "checkpoint-8" / "results.json")
    (out / "checkpoint-16" / "details").unlink()
    assert within(60, main, sweep_args(run_dir, out, "--no-report")) == 1
    failed = {r["step"]: r["error"] for r in read_table(out) if r["error"]}
    assert set(failed) == {8} and "FIFO" in failed[8], failed


def test_a_table_entry_folder_found_at_the_end_is_one_error_line(capsys, tmp_path, run_dir):
    """Planted while the sweep runs (after the start-up check): the write is refused at the end, with one line."""
    from nano_eval.sweep import runner

    out = tmp_path / "out"
    real = runner.SweepRunner._process

    def plant_then_process(self, item):
        (out / "sweep_signal.csv").mkdir(exist_ok=True)
        return real(self, item)

    runner.SweepRunner._process = plant_then_process
    try:
        refused(capsys, sweep_args(run_dir, out, "--no-report"), "sweep_signal.csv", "is a folder")
    finally:
        runner.SweepRunner._process = real
    assert json.loads((out / "checkpoint-8" / "results.json").read_text())["results"][TASK]  # results kept


# ---- the local launcher: nothing in the output folder is unpickled, and no job is adopted from a pid -------------

class _Payload:
    """Unpickling this creates `marker` (what a planted result pickle would do)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _forge_job(out: Path, marker: Path, *, status: bool, run_dir: Path) -> subprocess.Popen:
    """A process whose command line holds `submitit.local._local <out>/jobs` (anyone can start one), recorded in
    running.json as a job of this sweep, with a result pickle beside it that runs code when unpickled."""
    jobs = out / "jobs"
    jobs.mkdir(parents=True)
    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(4)", "-m", "submitit.local._local",
                             str(jobs)])
    submission = "ab" * 16
    (jobs / f"{fake.pid}_0_result.pkl").write_bytes(pickle.dumps(("success", _Payload(marker))))
    (jobs / f"{fake.pid}_submitted.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    (jobs / "running.json").write_text(json.dumps({str(fake.pid): {
        "launcher": "local", "attempt": 1, "submission": submission,
        "checkpoints": {"checkpoint-8": "whatever", "checkpoint-16": "whatever"}}}))
    if status:  # a forged status file too: the job is waited for, its outcome read from plain JSON only
        (jobs / "status").mkdir()
        (jobs / "status" / f"{submission}.json").write_text(json.dumps({
            "submission": submission, "job_id": str(fake.pid), "state": "running", "checkpoints": {}}))
    return fake


@pytest.mark.parametrize("status", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_forged_job_record_never_runs_a_planted_pickle(capsys, tmp_path, run_dir, monkeypatch, status):
    pytest.importorskip("submitit")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out, marker = tmp_path / "out", tmp_path / "pwned"
    fake = _forge_job(out, marker, status=status, run_dir=run_dir)
    try:
        code = within(300, main, sweep_args(run_dir, out, "--no-report", "--launcher", "local", "--group-size", "2"))
    finally:
        fake.kill()
        fake.wait()
    captured = capsys.readouterr()
    assert not marker.exists(), "a pickle from the output folder was loaded"
    assert code == 0, captured.err[-3000:]
    if not status:
        assert f"job {fake.pid} of an earlier run" in captured.out and "is not waited for" in captured.out
    for name in ("checkpoint-8", "checkpoint-16"):
        assert json.loads((out / name / "results.json").read_text())["results"][TASK]
    assert not os.stat(out / "jobs").st_mode & 0o022  # submitit's files live in a folder only this user writes


@pytest.mark.parametrize("content", [
    "{not json", '{"123": {"launcher": "local"}}', '{"1": []}',
    # a Slurm job whose comment is not one a driver gives (nano_eval_sweep:<16 hex>), a submission record whose
    # groups and submission ids do not pair up
    '{"12_0": {"launcher": "slurm", "attempt": 1, "submission": "' + "ab" * 16 + '", "checkpoints": {}, '
    '"slurm_comment": "nano_eval_sweep:me"}}',
    '{"submitting": {"launcher": "slurm", "checkpoints": {}, "groups": [["checkpoint-8"]], "submissions": []}}'])
def test_a_malformed_running_file_is_refused_before_anything_is_submitted(capsys, tmp_path, run_dir, content):
    pytest.importorskip("submitit")
    out = tmp_path / "out"
    (out / "jobs").mkdir(parents=True)
    (out / "jobs" / "running.json").write_text(content)
    refused(capsys, sweep_args(run_dir, out, "--no-report", "--launcher", "local"), "running.json",
            "no job of an earlier sweep")
    assert not list((out / "jobs").glob("*.pkl"))
    assert (out / "jobs" / "running.json").read_text() == content


def test_a_symlinked_jobs_folder_is_refused(capsys, tmp_path, run_dir, victim):
    pytest.importorskip("submitit")
    out = tmp_path / "out"
    out.mkdir()
    (out / "jobs").symlink_to(victim)
    refused(capsys, sweep_args(run_dir, out, "--no-report", "--launcher", "local"), "jobs", "symlink")


# ---- the training hook --------------------------------------------------------------------------------------------

def _hook(toy_backend, out: Path, **kw):
    from nano_eval.training.hook import EvalHook
    from nano_eval.training.config import EvalHookConfig

    return EvalHook(EvalHookConfig(tasks=TASK, max_samples=2, output_dir=out, **kw), toy_backend)


def test_the_hook_refuses_a_bad_output_entry_when_built(tmp_path, toy_backend, victim):
    from nano_eval.errors import NanoEvalError

    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "eval_results.jsonl")
    with pytest.raises(NanoEvalError, match="eval_results.jsonl is a FIFO.*Fix:") as raised:
        within(60, _hook, toy_backend, out)
    assert raised.value.exit_code == 2 and "\n" not in str(raised.value)


def test_a_bad_output_entry_at_evaluation_time_never_stops_training(tmp_path, toy_backend, victim, capsys):
    """Planted after the hook was built: a FIFO log, a step folder that is a symlink. With fail_soft each is an
    evaluation failure (None, a warning), training goes on, nothing blocks and nothing is written outside."""
    out = tmp_path / "out"
    hook = _hook(toy_backend, out, fail_soft=True)
    out.mkdir(exist_ok=True)
    os.mkfifo(out / "eval_results.jsonl")
    start = time.monotonic()
    assert within(60, hook, 1) is None
    (out / "step_2").symlink_to(victim)
    (out / "eval_results.jsonl").unlink()
    assert within(60, hook, 2) is None
    assert hook.failed_steps == [1, 2] and time.monotonic() - start < 60
    assert within(60, hook, 3) is not None  # a sound folder again: the hook goes on as before
    err = capsys.readouterr().err
    assert "FIFO" in err and "step_2" in err and "training continues" in err
    hook.close()
