"""Sweeps as real processes: killed midway (SIGKILL) and restarted, watch mode picking up a checkpoint written after
it started (and never reading it half-written), stopping on a signal, and two data-parallel ranks under torchrun."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nano_eval.checkpoints.load import fingerprint
from nano_eval.cli import main as run_main
from tests.dist_utils import free_port
from tests.sweep_utils import TASKS, one_thread, train_run_dir

MAX_SAMPLES = "6"
STEPS = [8, 16, 24, 32, 40]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _args(run: Path, out: Path, *extra: str) -> list[str]:
    return ["sweep", str(run), "--tasks", TASKS, "--output-dir", str(out), "--max-samples", MAX_SAMPLES,
            "--settle-s", "0", *extra]


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nano_eval", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=ENV)


def _wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}:\n{log.read_text()[-3000:] if log else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s:\n{log.read_text()[-3000:] if log else ''}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """Five checkpoints of one short training run, and an uninterrupted in-process sweep of them."""
    base = tmp_path_factory.mktemp("sweep_proc")
    train_run_dir(base / "run", saves=5, steps_per_save=8)
    with one_thread():
        assert run_main(_args(base / "run", base / "full")) == 0
    return base / "run", base / "full"


def _results(path: Path) -> dict:
    return json.loads((path / "results.json").read_text())


def test_killed_sweep_restarts_without_re_evaluating(full, tmp_path, capsys):
    run, reference = full
    out, log = tmp_path / "out", tmp_path / "log.txt"
    proc = _spawn(_args(run, out), log)
    try:
        _wait_for(lambda: (out / "sweep_results.csv").exists(), 180, proc, log)  # written after each checkpoint
        proc.send_signal(signal.SIGKILL)  # a crash: no handler runs, nothing gets tidied up
    finally:
        proc.kill()
        proc.wait()
    finished = sorted(p.parent.name for p in out.glob("checkpoint-*/results.json"))
    assert 1 <= len(finished) < len(STEPS), finished  # killed midway
    mtimes = {name: (out / name / "results.json").stat().st_mtime_ns for name in finished}
    assert (out / "sweep_results.csv").read_text().count("\n") > 1  # the killed one-shot sweep left its table

    with one_thread():
        assert run_main(_args(run, out)) == 0
    printed = capsys.readouterr().out
    assert f"{len(STEPS) - len(finished)} evaluated, {len(finished)} reused" in printed
    for name in finished:
        assert f"{name} (step {name.split('-')[1]}): already evaluated" in printed
        assert (out / name / "results.json").stat().st_mtime_ns == mtimes[name]  # not rewritten
    assert (out / "sweep_results.csv").read_text() == (reference / "sweep_results.csv").read_text()


def test_watch_picks_up_a_checkpoint_written_after_it_started(full, tmp_path):
    run, reference = full
    watched, out, log = tmp_path / "run", tmp_path / "out", tmp_path / "log.txt"
    watched.mkdir()
    shutil.copytree(run / "checkpoint-8", watched / "checkpoint-8")
    proc = _spawn(_args(watched, out, "--watch", "--poll-s", "0.2", "--settle-s", "1", "--until-step", "16"), log)
    try:
        _wait_for(lambda: (out / "checkpoint-8" / "results.json").exists(), 180, proc, log)
        # Training writes checkpoint-16 now: everything but the weights, then half of the weights.
        new, source = watched / "checkpoint-16", run / "checkpoint-16"
        new.mkdir()
        for f in source.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, new / f.name)
        weights = (source / "model.safetensors").read_bytes()
        (new / "model.safetensors").write_bytes(weights[: len(weights) // 2])
        time.sleep(2.5)  # > poll + settle: a watcher that read half-written checkpoints would have started
        assert proc.poll() is None and not (out / "checkpoint-16").exists()
        (new / "model.safetensors").write_bytes(weights)
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]  # --until-step 16 ends it
    finally:
        proc.kill()
        proc.wait()
    assert "watching" in log.read_text()
    doc = _results(out / "checkpoint-16")
    assert doc["sweep"]["fingerprint"] == fingerprint(new)  # the finished weights were read
    assert doc["results"] == _results(reference / "checkpoint-16")["results"]
    assert (out / "sweep_results.csv").read_text() == "".join(
        line for line in (reference / "sweep_results.csv").read_text().splitlines(keepends=True)
        if line.startswith(("checkpoint,", "checkpoint-8,", "checkpoint-16,")))


@pytest.mark.slow
def test_watch_stops_cleanly_on_sigterm(full, tmp_path):
    run, _ = full
    watched, out, log = tmp_path / "run", tmp_path / "out", tmp_path / "log.txt"
    watched.mkdir()
    shutil.copytree(run / "checkpoint-8", watched / "checkpoint-8")
    proc = _spawn(_args(watched, out, "--watch", "--poll-s", "60"), log)
    try:
        _wait_for(lambda: (out / "sweep_results.csv").exists(), 180, proc, log)
        proc.send_signal(signal.SIGTERM)
        # did not sit out the 60 s poll, and a scheduler can tell it was stopped: 128 + SIGTERM
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    assert "SIGTERM received" in log.read_text()
    assert (out / "report" / "index.html").exists()


@pytest.mark.slow
def test_two_data_parallel_ranks_sweep_like_one(full, tmp_path):
    run, reference = full
    out = tmp_path / "two"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "nano_eval", *_args(run, out, "--last", "2", "--batch-tokens", "64")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[:3000] + "\n...\n" + proc.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-32", "checkpoint-40"]
    for name in ("checkpoint-32", "checkpoint-40"):
        two, one = _results(out / name), _results(reference / name)
        assert two["layout"]["dp"] == 2
        for task, metrics in one["results"].items():
            for metric, value in metrics.items():
                if metric.startswith(("acc", "exact", "quasi")):
                    assert two["results"][task][metric] == value, (name, task, metric)
                else:
                    assert two["results"][task][metric] == pytest.approx(value, rel=1e-5), (name, task, metric)
