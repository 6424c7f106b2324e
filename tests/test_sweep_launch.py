"""Sweeps fanned out as submitit jobs (`--launcher local|slurm`).

The local launcher runs real submitit jobs (LocalExecutor: a controller process per job, one task process each) on
checkpoints of a real short training run (tests/sweep_utils.py): 3 jobs over 6 checkpoints give exactly the
sequential sweep's files, a job killed mid-way is reported with its log and retried without redoing what it had
finished, a second sweep into the busy folder is refused, and rerunning the command submits nothing.

The Slurm launcher runs against a real one-node cluster in tests/test_sweep_slurm.py. Here the sbatch script the
executor would submit is built by submitit's own SlurmExecutor and inspected, for what that cluster cannot have
(GPUs, several nodes, an account). Its constructor refuses to run where `srun` is missing, so that test puts a
stand-in `srun` (a shell script that only exits 0, never called for the sbatch text) on PATH.
"""

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from nano_eval.cli import main as run_main
from tests.sweep_utils import one_thread, train_run_dir

pytest.importorskip("submitit")

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"
STEPS = [8, 16, 24, 32, 40, 48]


def _args(run: Path, out: Path, *extra: str) -> list[str]:
    return ["sweep", str(run), "--tasks", TASKS, "--output-dir", str(out), "--max-samples", "4", "--settle-s", "0",
            *extra]


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """Six checkpoints of one short training run, and the sequential (in-process) sweep of them."""
    base = tmp_path_factory.mktemp("launch")
    train_run_dir(base / "run", saves=6, steps_per_save=8)
    with one_thread():
        assert run_main(_args(base / "run", base / "sequential", "--no-report")) == 0
    return base / "run", base / "sequential"


def _job_logs(jobs: Path) -> dict[str, tuple[int, list[str]]]:
    """{job id: (pid of its task process, its checkpoints)} for every job that has started its group."""
    found = {}
    for log in jobs.glob("*_0_log.out"):
        m = re.search(r"nano_eval job: pid (\d+), checkpoints (.+)", log.read_text())
        if m:
            found[log.name.split("_")[0]] = (int(m.group(1)), m.group(2).split(", "))
    return found


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)
    return value


@pytest.mark.slow
def test_local_launcher_equals_sequential_survives_a_killed_job_and_reruns_idempotently(sequential, tmp_path,
                                                                                        capsys, monkeypatch):
    run, reference = sequential
    out = tmp_path / "out"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the job processes inherit it: 3 jobs share 2 cores
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    codes = []
    driver = threading.Thread(target=lambda: codes.append(run_main(
        _args(run, out, "--no-report", "--launcher", "local", "--group-size", "2"))))
    driver.start()
    try:
        # A second sweep into the folder the driver holds is refused (and touches nothing).
        _wait(lambda: (out / "sweep_settings.json").exists(), 120, "the driver to claim its folder")
        assert run_main(_args(run, out)) == 2
        assert "is in use by another sweep" in capsys.readouterr().err

        # Kill one job's process (SIGKILL: nothing tidies up) once it has written its first checkpoint.
        def first_done():
            for job_id, (pid, names) in _job_logs(out / "jobs").items():
                if (out / names[0] / "results.json").exists():
                    return job_id, pid, names
            return None

        job_id, pid, names = _wait(first_done, 240, "a job's first checkpoint")
        os.kill(pid, signal.SIGKILL)
        first_mtime = (out / names[0] / "results.json").stat().st_mtime_ns
        assert not (out / names[1] / "results.json").exists(), "the job finished its group before the kill"
    finally:
        driver.join(timeout=600)
    assert codes == [0]
    printed = capsys.readouterr()
    log = out / "jobs" / f"{job_id}_0_log.err"
    assert f"job {job_id} ({', '.join(names)}) failed: ended without a result" in printed.err
    assert f"log: {log}; resubmitting what it left unscored once" in printed.err and log.exists()
    assert re.search(rf"job \d+ resubmitted: {names[1]} \(log: ", printed.out)  # only what it had left
    assert "6 evaluated, 0 reused" in printed.out
    assert (out / names[0] / "results.json").stat().st_mtime_ns == first_mtime  # not scored twice

    # Exactly the sequential sweep: the same table, the same scores and details per checkpoint.
    assert (out / "sweep_results.csv").read_text() == (reference / "sweep_results.csv").read_text()
    for step in STEPS:
        ours, theirs = (json.loads((d / f"checkpoint-{step}" / "results.json").read_text()) for d in (out, reference))
        assert ours["results"] == theirs["results"] and ours["sweep"] == theirs["sweep"], step
        assert sorted(p.name for p in (out / f"checkpoint-{step}" / "details").iterdir()) == sorted(
            p.name for p in (reference / f"checkpoint-{step}" / "details").iterdir())

    # Rerunning the command submits nothing and changes nothing.
    jobs_before = sorted(p.name for p in (out / "jobs").iterdir())
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("checkpoint-*/results.json")}
    assert run_main(_args(run, out, "--no-report", "--launcher", "local", "--group-size", "2")) == 0
    assert "0 evaluated, 6 reused" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "jobs").iterdir()) == jobs_before
    assert {p: p.stat().st_mtime_ns for p in out.glob("checkpoint-*/results.json")} == mtimes
    assert (out / "sweep_results.csv").read_text() == (reference / "sweep_results.csv").read_text()


@pytest.mark.slow
def test_a_job_that_fails_twice_is_recorded_with_its_log(sequential, tmp_path, capsys, monkeypatch):
    import shutil

    from nano_eval.sweep.table import read_table

    run = tmp_path / "run"
    shutil.copytree(sequential[0] / "checkpoint-8", run / "checkpoint-8")
    shutil.copytree(sequential[0] / "checkpoint-16", run / "checkpoint-16")
    (run / "checkpoint-16" / "config.json").write_text("{not json")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    assert run_main(_args(run, out, "--no-report", "--launcher", "local")) == 1
    err = capsys.readouterr().err
    assert err.count("checkpoint-16) failed:") == 2 and "no more retries" in err
    rows = read_table(out)
    [failed] = [r for r in rows if r["error"]]
    assert failed["step"] == 16 and "failed twice" in failed["error"] and "config.json" in failed["error"]
    assert re.search(r"log: \S+/jobs/\d+_0_log\.err", failed["error"])
    assert {r["step"] for r in rows if not r["error"]} == {8}


@pytest.mark.slow
def test_watch_submits_each_new_checkpoint_as_it_appears(sequential, tmp_path, monkeypatch):
    import shutil

    run, reference = sequential
    watched, out = tmp_path / "run", tmp_path / "out"
    shutil.copytree(run / "checkpoint-8", watched / "checkpoint-8")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    codes = []
    driver = threading.Thread(target=lambda: codes.append(run_main(
        _args(watched, out, "--no-report", "--launcher", "local", "--watch", "--poll-s", "0.2", "--until-step", "16"))))
    driver.start()
    try:
        _wait(lambda: (out / "checkpoint-8" / "results.json").exists(), 240, "the first checkpoint")
        shutil.copytree(run / "checkpoint-16", tmp_path / "checkpoint-16.tmp")  # written, then renamed into place
        (tmp_path / "checkpoint-16.tmp").rename(watched / "checkpoint-16")
    finally:
        driver.join(timeout=600)
    assert codes == [0]
    assert len(list((out / "jobs").glob("*_submitted.pkl"))) == 2  # one job per checkpoint, as each appeared
    for step in (8, 16):
        ours, theirs = (json.loads((d / f"checkpoint-{step}" / "results.json").read_text()) for d in (out, reference))
        assert ours["results"] == theirs["results"], step


@pytest.mark.slow
def test_a_job_with_two_ranks_scores_data_parallel_like_one(sequential, tmp_path, monkeypatch):
    """`--gpus-per-node 2` on the local launcher: one job, two task processes that join one gloo group through
    submitit's TorchDistributedEnvironment and evaluate data-parallel (what srun does on a Slurm node)."""
    import shutil

    run, reference = sequential
    one = tmp_path / "run"
    shutil.copytree(run / "checkpoint-48", one / "checkpoint-48")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    assert run_main(_args(one, out, "--no-report", "--launcher", "local", "--gpus-per-node", "2")) == 0
    ours, theirs = (json.loads((d / "checkpoint-48" / "results.json").read_text()) for d in (out, reference))
    assert ours["layout"]["dp"] == 2 and theirs["layout"]["dp"] == 1
    for task, metrics in theirs["results"].items():
        for metric, value in metrics.items():
            assert ours["results"][task][metric] == pytest.approx(value, rel=1e-5, abs=1e-9), (task, metric)
    assert "rank 1 of 2" in next((out / "jobs").glob("*_1_log.err")).read_text()


@pytest.mark.slow
def test_sigterm_cancels_the_running_jobs(sequential, tmp_path):
    import shutil
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(sequential[0] / "checkpoint-8", run / "checkpoint-8")
    out, log = tmp_path / "out", tmp_path / "log.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "nano_eval", *_args(run, out, "--launcher", "local", "--watch",
                                                                        "--poll-s", "0.2")],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        _, (pid, names) = _wait(lambda: next(iter(_job_logs(out / "jobs").items()), None), 240, "the job to start")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    finally:
        proc.kill()
        proc.wait()
    assert names == ["checkpoint-8"] and "cancelled before scoring checkpoint-8" in log.read_text()
    _wait(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
          30, "the job's process to end")


@pytest.mark.slow
def test_a_restarted_driver_waits_for_the_jobs_the_killed_one_left_running(sequential, tmp_path):
    """The driver is SIGKILLed while its jobs run (a login shell that ended): the jobs go on; the same command run
    again waits for them (running.json) and scores nothing twice."""
    import subprocess
    import sys

    run, reference = sequential
    out, log = tmp_path / "out", tmp_path / "log.txt"
    args = [sys.executable, "-m", "nano_eval", *_args(run, out, "--no-report", "--launcher", "local",
                                                      "--group-size", "3")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    try:
        jobs = _wait(lambda: len(_job_logs(out / "jobs")) == 2 and _job_logs(out / "jobs"), 240, "both jobs")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert all(Path(f"/proc/{pid}").exists() for pid, _ in jobs.values())  # the jobs outlive their driver
    again = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    for job_id in jobs:
        assert re.search(rf"job {job_id} of an earlier run of this sweep \(checkpoint-[^)]*\) is still running",
                         again.stdout), again.stdout
    assert "submitted" not in again.stdout  # nothing scored twice
    assert len(list((out / "jobs").glob("*_submitted.pkl"))) == 2
    assert (out / "sweep_results.csv").read_text() == (reference / "sweep_results.csv").read_text()
    for job_id in jobs:  # each job scored its checkpoints once
        log_text = (out / "jobs" / f"{job_id}_0_log.out").read_text()
        assert re.findall(r"nano_eval job: (checkpoint-\d+) \(step", log_text) == jobs[job_id][1]


# ---- what the executors are given ---------------------------------------------------------------------------------

def test_slurm_job_script_carries_the_options(tmp_path, monkeypatch):
    from submitit.slurm.slurm import _make_sbatch_string

    from nano_eval.cli.sweep import launch_options, parse
    from nano_eval.sweep.launch import make_executor

    args = parse(["run", "--tasks", "demo|arithmetic|0", "--launcher", "slurm", "--slurm-partition", "h100",
                  "--gpus-per-node", "8", "--nodes", "2", "--time", "90", "--account", "pretrain",
                  "--array-parallelism", "4", "--group-size", "5"])
    options = launch_options(args)
    assert options.group_size == 5
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun: not a Slurm machine
    from nano_eval.errors import NanoEvalError

    with pytest.raises(NanoEvalError, match="srun.*Fix: run the sweep on a Slurm login node"):
        make_executor(options, tmp_path / "jobs")
    srun = tmp_path / "srun"  # stand-in so submitit's SlurmExecutor can be built (see the module docstring)
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(0o755)
    executor = make_executor(options, tmp_path / "jobs")
    script = executor._make_submission_file_text(executor._submitit_command_str, "uid")
    for line in ("#SBATCH --partition=h100", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --nodes=2", "#SBATCH --time=90", "#SBATCH --account=pretrain",
                 "#SBATCH --job-name=nano_eval_sweep"):
        assert line in script, (line, script)
    assert "srun" in script and "submitit.core._submit" in script  # srun starts one rank per GPU
    assert "--kill-on-bad-exit=1" in script  # a rank that dies ends the job's other ranks
    assert "#SBATCH --signal=USR2@90" in script  # submitit's time-limit signal, 90 s before the end
    array = _make_sbatch_string(command="x", folder=tmp_path, map_count=7, **executor.parameters)
    assert "#SBATCH --array=0-6%4" in array
    cpu = launch_options(parse(["run", "--tasks", "demo|arithmetic|0", "--launcher", "slurm", "--gpus-per-node", "0",
                                "--ranks-per-node", "2"]))
    cpu_script = make_executor(cpu, tmp_path / "jobs")._make_submission_file_text("x", "uid")
    assert "#SBATCH --ntasks-per-node=2" in cpu_script and "gpus" not in cpu_script  # 2 CPU ranks, no GPU asked


def test_launcher_options_are_checked_before_anything_runs(tmp_path, capsys):
    from nano_eval.cli.sweep import build_parser

    helptext = build_parser().format_help()
    for default in ("checkpoints per job (default: 1)", "(default: 60)", "(default: 64)"):
        assert default in " ".join(helptext.split()), default
    run = tmp_path / "run"
    run.mkdir()
    assert run_main(["sweep", str(run), "--tasks", "demo|arithmetic|0", "--output-dir", str(tmp_path / "o"),
                     "--launcher", "local", "--nodes", "2"]) == 2
    assert "--launcher local runs its jobs on this machine: --nodes 2" in capsys.readouterr().err
    assert run_main(["sweep", str(run), "--tasks", "demo|arithmetic|0", "--output-dir", str(tmp_path / "o"),
                     "--launcher", "slurm", "--gpus-per-node", "8", "--ranks-per-node", "4"]) == 2
    assert "--ranks-per-node 4 with --gpus-per-node 8: each rank evaluates on its own GPU" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _reuse_seen_by(rank, world, folders):
    """Each rank of a job asks whether its own copy of the results is done: rank 0's answer must win."""
    from nano_eval.sweep.worker import _already_done

    return _already_done(Path(folders[rank]) / "results.json", "identity-1")


@pytest.mark.slow
def test_a_jobs_ranks_take_rank_0s_reuse_decision(tmp_path):
    """Rank 0 reads the file system and broadcasts; a rank that sees another file (a lagging shared file system)
    does not decide alone (it would skip a checkpoint the others evaluate, and they would wait on it)."""
    from tests.dist_utils import run_distributed

    done, missing = tmp_path / "done", tmp_path / "missing"
    done.mkdir()
    (done / "results.json").write_text(json.dumps({"sweep": {"evaluation_identity": "identity-1"}, "results": {}}))
    assert run_distributed(_reuse_seen_by, 2, [str(done), str(missing)]) == [True, True]
    assert run_distributed(_reuse_seen_by, 2, [str(missing), str(done)]) == [False, False]


# ---- a driver that dies while submitting ---------------------------------------------------------------------------

@pytest.mark.slow
def test_checkpoints_are_recorded_before_their_jobs_are_submitted(sequential, tmp_path, capsys, monkeypatch):
    """The driver dies inside the submission (here: submitit's own submit raises): running.json already names the
    checkpoints it was submitting, and the restarted driver says so, then scores them once."""
    import shutil

    import submitit.local.local as submitit_local

    run = tmp_path / "run"
    for name in ("checkpoint-8", "checkpoint-16"):
        shutil.copytree(sequential[0] / name, run / name)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "out"
    seen = {}

    def dies(self, *args, **kwargs):
        seen["running"] = json.loads((out / "jobs" / "running.json").read_text())
        raise RuntimeError("the driver died here")

    with monkeypatch.context() as patch:
        patch.setattr(submitit_local.LocalExecutor, "_internal_process_submissions", dies)
        assert run_main(_args(run, out, "--no-report", "--launcher", "local")) != 0
    assert set(seen["running"]["submitting"]["checkpoints"]) == {"checkpoint-8", "checkpoint-16"}
    assert "the driver died here" in capsys.readouterr().err
    # a failing driver clears its record on the way out; a SIGKILLed one leaves it as it was at that moment
    (out / "jobs" / "running.json").write_text(json.dumps(seen["running"]))
    assert run_main(_args(run, out, "--no-report", "--launcher", "local")) == 0
    printed = capsys.readouterr().out
    assert "stopped while submitting jobs for checkpoint-8, checkpoint-16" in printed
    expected = [line for line in (sequential[1] / "sweep_results.csv").read_text().splitlines()
                if ",8," in line or ",16," in line]
    assert sorted((out / "sweep_results.csv").read_text().splitlines()[1:]) == sorted(expected)
    assert "submitting" not in json.loads((out / "jobs" / "running.json").read_text())


def _hold_claim_then_finish(out: str, name: str, identity: str, hold_s: float) -> None:
    """Another job: holds checkpoint `name`'s claim, writes its results, lets go (runs in a child process)."""
    import json as json_
    import time as time_
    from pathlib import Path as Path_

    from nano_eval.sweep.worker import claim_checkpoint

    with claim_checkpoint(Path_(out), name):
        Path_(out, "ready").write_text("1")
        time_.sleep(hold_s)
        Path_(out, name).mkdir()
        Path_(out, name, "results.json").write_text(json_.dumps({"sweep": {"evaluation_identity": identity},
                                                                 "results": {}}))


def test_a_job_waits_for_the_job_scoring_the_same_checkpoint_then_reuses_it(tmp_path, capsys):
    """Two jobs given one checkpoint (a restarted driver submitted it again): the second waits for the first's claim
    and then finds its results, instead of scoring the checkpoint a second time."""
    import multiprocessing

    from nano_eval.sweep.worker import _already_done, claim_checkpoint

    other = multiprocessing.get_context("spawn").Process(
        target=_hold_claim_then_finish, args=(str(tmp_path), "checkpoint-8", "identity-1", 1.5))
    other.start()
    try:
        _wait(lambda: (tmp_path / "ready").exists(), 60, "the other job's claim")
        start = time.monotonic()
        with claim_checkpoint(tmp_path, "checkpoint-8"):
            waited = time.monotonic() - start
            done = _already_done(tmp_path / "checkpoint-8" / "results.json", "identity-1")
    finally:
        other.join(timeout=60)
        other.kill()
    assert waited > 1.0 and done
    assert "checkpoint-8 is being scored by another job" in capsys.readouterr().out
    with claim_checkpoint(tmp_path, "checkpoint-8", hold=False):  # the job's other ranks hold nothing
        pass


def test_a_slurm_queue_that_does_not_answer_ends_no_job(tmp_path, monkeypatch, capsys):
    """squeue missing or failing (slurmctld restarting): the driver is told once, counts every job as still running
    (it never resubmits blind), and asks again; the real squeue is exercised in tests/test_sweep_slurm.py."""
    from nano_eval.errors import NanoEvalError
    from nano_eval.sweep.slurm import Queue, is_comment, list_jobs, new_comment

    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm commands here
    queue = Queue(every_s=0)
    assert queue.jobs() is None and queue.jobs() is None
    err = capsys.readouterr().err
    assert err.count("`squeue --noheader") == 1 and "assumed to be still running" in err
    with pytest.raises(NanoEvalError, match="Fix: run the sweep where Slurm's commands answer"):
        list_jobs()
    assert is_comment(new_comment()) and new_comment() != new_comment() and not is_comment("nano_eval_sweep:x")
