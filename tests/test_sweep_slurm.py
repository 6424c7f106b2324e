"""`nano_eval sweep --launcher slurm` against a real Slurm: the one-node cluster of scripts/slurm_cluster.sh
(Debian's slurm-wlm 22.05: slurmctld + slurmd on localhost, partition `debug` of 2 CPUs, slurmdbd on MariaDB so
that sacct answers). `.ci/run` starts it and sets NANO_EVAL_REQUIRE_SLURM=1, so these tests fail there rather than
skip; elsewhere they skip with the command that starts the cluster. They run only on that test cluster (its
ClusterName is checked): they requeue jobs and take its node down.

Every sweep here is compared with the sequential (in-process) sweep of the same toy checkpoints (a real short
training run, tests/sweep_utils.py): the same table, byte for byte. Jobs run CPU-only (`--gpus-per-node 0`).
To hold a job at a chosen point without burning CPU, a test takes a checkpoint's claim itself
(`<out>/jobs/claims/<checkpoint>.lock`, worker.claim_checkpoint): the job scoring that checkpoint waits for it,
as it would for another job scoring it, and goes on once the test lets go.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from nano_eval.cli import main as run_main
from tests.sweep_utils import one_thread, train_run_dir

pytest.importorskip("submitit")

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"
CLUSTER = "nanoeval"  # scripts/slurm_cluster.sh's ClusterName
HOW = ("start the one-node test cluster with `sudo bash scripts/slurm_cluster.sh start` (installs Debian's slurm-wlm, "
       "slurmdbd, munge and mariadb-server if missing; `... stop` stops it)")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # jobs inherit the driver's env


def _cluster_problem() -> str | None:
    """Why the Slurm tests cannot run here, or None."""
    for argv in (["sinfo", "--noheader"], ["sacct", "--noheader", "--allocations", "--starttime=now-1minutes"],
                 ["scontrol", "show", "config"]):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"`{' '.join(argv)}` does not answer ({e})"
        if done.returncode != 0:
            return f"`{' '.join(argv)}` failed: {' '.join(done.stderr.split())[:300]}"
    name = re.search(r"^ClusterName\s*=\s*(\S+)", done.stdout, re.M)
    if name is None or name.group(1) != CLUSTER:
        return (f"the Slurm cluster that answers is {name.group(1) if name else 'unnamed'}, not the test cluster "
                f"`{CLUSTER}` (these tests requeue jobs and take the node down)")
    return None


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    problem = _cluster_problem()
    if problem is not None:
        if os.environ.get("NANO_EVAL_REQUIRE_SLURM") == "1":
            pytest.fail(f"NANO_EVAL_REQUIRE_SLURM=1 but {problem}. Fix: {HOW}.")
        pytest.skip(f"no Slurm test cluster here ({problem}): {HOW}")


def _queue() -> dict[str, tuple[str, str]]:
    """{job id: (state, comment)} of this user's jobs that slurmctld knows (ended ones too, for MinJobAge)."""
    out = subprocess.run(["squeue", "--noheader", "--array", "--states=all", f"--user={os.getuid()}",
                          "--format=%i|%T|%k"], capture_output=True, text=True, timeout=30, check=True).stdout
    return {line.split("|")[0]: tuple(line.split("|", 2)[1:]) for line in out.splitlines()}


ACTIVE = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SUSPENDED", "REQUEUE_HOLD")


@pytest.fixture(autouse=True)
def no_job_left():
    """A test leaves no job of its own queued or running (cancelled and failed otherwise)."""
    before = set(_queue())
    yield
    deadline = time.monotonic() + 30  # a job that just ended may still be COMPLETING
    while (left := {j: s for j, (s, _) in _queue().items() if j not in before and s in ACTIVE}) and \
            time.monotonic() < deadline:
        time.sleep(1)
    if left:
        subprocess.run(["scancel", *left], timeout=30)
        pytest.fail(f"the test left Slurm jobs behind: {left}")


def _args(run: Path, out: Path, *extra: str) -> list[str]:
    return ["sweep", str(run), "--tasks", TASKS, "--output-dir", str(out), "--max-samples", "4", "--settle-s", "0",
            "--no-report", "--launcher", "slurm", "--gpus-per-node", "0", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Four checkpoints of one short training run, and the sequential (in-process) sweep of them."""
    base = tmp_path_factory.mktemp("slurm")
    train_run_dir(base / "run", saves=4, steps_per_save=8)
    with one_thread():
        assert run_main(["sweep", str(base / "run"), "--tasks", TASKS, "--output-dir", str(base / "sequential"),
                         "--max-samples", "4", "--settle-s", "0", "--no-report"]) == 0
    return base / "run", base / "sequential"


def _run_of(reference, tmp_path: Path, steps) -> Path:
    run = tmp_path / "run"
    for step in steps:
        shutil.copytree(reference[0] / f"checkpoint-{step}", run / f"checkpoint-{step}")
    return run


def _table_of(folder: Path, steps=None) -> list[str]:
    """The table's header and its rows for `steps` (all when None)."""
    lines = (folder / "sweep_results.csv").read_text().splitlines()
    return lines[:1] + [line for line in lines[1:] if steps is None or int(line.split(",")[1]) in steps]


def _wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.2)
    return value


def _driver(args: list[str], log: Path) -> subprocess.Popen:
    """The sweep's driver as its own process (as a user starts it), its output in `log`."""
    return subprocess.Popen([sys.executable, "-m", "nano_eval", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=ENV)


@contextmanager
def _driving(args: list[str], log: Path):
    proc = _driver(args, log)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def _running(out: Path) -> dict:
    try:
        return json.loads((out / "jobs" / "running.json").read_text())
    except (OSError, ValueError):
        return {}


@contextmanager
def _claim(out: Path, name: str):
    """Hold checkpoint `name`'s claim, as a job scoring it would: a job given it waits until `release()` (yielded)
    or the end of the block."""
    from nano_eval.local_files import lock_file
    from nano_eval.sweep.worker import CLAIMS_DIR, JOBS_DIR

    out.mkdir(parents=True, exist_ok=True)
    held = [lock_file(out / JOBS_DIR / CLAIMS_DIR / f"{name}.lock", root=out)]

    def release():
        if held[0] is not None:
            os.close(held[0])
            held[0] = None

    try:
        yield release
    finally:
        release()


def _waiting_on_claim(out: Path, job_id: str, name: str) -> bool:
    log = out / "jobs" / f"{job_id}_0_log.out"
    return log.exists() and f"{name} is being scored by another job" in log.read_text()


def _scored_lines(out: Path, job_id: str) -> list[str]:
    """The checkpoints job `job_id` scored, over all its runs (a requeued job appends to its log)."""
    return re.findall(r"nano_eval job: (checkpoint-\d+) \(step \d+\): evaluated",
                      (out / "jobs" / f"{job_id}_0_log.out").read_text())


def _completed(array: str, count: int) -> dict[str, list[str]] | None:
    """{element: [state, start, end]} from sacct once all `count` elements of `array` are COMPLETED, else None."""
    sacct = subprocess.run(["sacct", "--noheader", "--parsable2", "--allocations", "-j", array,
                            "--format=JobID,State,Start,End"], capture_output=True, text=True, check=True).stdout
    rows = {line.split("|")[0]: line.split("|")[1:] for line in sacct.splitlines()}
    return rows if len(rows) == count and all(r[0] == "COMPLETED" for r in rows.values()) else None


# ---- what the README promises ---------------------------------------------------------------------------------------

def test_a_job_array_gives_the_sequential_table_and_a_rerun_submits_nothing(reference, tmp_path, capsys,
                                                                             monkeypatch):
    """4 checkpoints, --group-size 2, --array-parallelism 1: one sbatch, an array of 2 jobs that Slurm runs one at
    a time (sacct's start and end times), each scoring its 2 checkpoints; the table is the sequential sweep's.
    The same command again finds everything done and submits nothing."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run, out = reference[0], tmp_path / "out"
    queued_before = set(_queue())
    assert run_main(_args(run, tmp_path / "refused", "--slurm-partition", "nope")) == 2  # sbatch says no
    err = capsys.readouterr().err
    assert "could not be submitted: sbatch: error: invalid partition specified: nope" in err, err
    assert "Fix: check --slurm-partition" in err and "Traceback" not in err and set(_queue()) == queued_before

    assert run_main(_args(run, out, "--group-size", "2", "--array-parallelism", "1")) == 0
    printed = capsys.readouterr().out
    [script] = (out / "jobs").glob("*_submission.sh")
    text = script.read_text()
    assert "#SBATCH --array=0-1%1" in text and "#SBATCH --comment=nano_eval_sweep:" in text, text
    array = script.name.split("_")[0]
    assert re.search(rf"job {array}_0 submitted: checkpoint-8, checkpoint-16 \(log: ", printed)
    assert re.search(rf"job {array}_1 submitted: checkpoint-24, checkpoint-32 \(log: ", printed)
    assert "4 evaluated, 0 reused" in printed
    assert _table_of(out) == _table_of(reference[1])
    for step in (8, 16, 24, 32):
        ours, theirs = (json.loads((d / f"checkpoint-{step}" / "results.json").read_text())
                        for d in (out, reference[1]))
        assert ours["results"] == theirs["results"] and ours["sweep"] == theirs["sweep"], step
    # Slurm's own accounting: both elements completed, never at the same time (%1). (The driver is done once the
    # jobs' results are in; their processes may still be exiting.)
    rows = _wait(lambda: _completed(array, 2), 60, "sacct to record both elements as COMPLETED")
    first, second = sorted((rows[f"{array}_0"], rows[f"{array}_1"]), key=lambda r: r[1])
    assert first[2] <= second[1], rows  # the second started once the first had ended

    jobs_before = sorted(p.name for p in (out / "jobs").iterdir())
    queued_before = set(_queue())
    mtimes = {p: p.stat().st_mtime_ns for p in out.glob("checkpoint-*/results.json")}
    assert run_main(_args(run, out, "--group-size", "2", "--array-parallelism", "1")) == 0
    assert "0 evaluated, 4 reused" in capsys.readouterr().out
    assert sorted(p.name for p in (out / "jobs").iterdir()) == jobs_before
    assert set(_queue()) == queued_before  # no job at all
    assert {p: p.stat().st_mtime_ns for p in out.glob("checkpoint-*/results.json")} == mtimes
    assert _table_of(out) == _table_of(reference[1])


@pytest.mark.slow
def test_a_job_cancelled_from_outside_is_resubmitted_once_with_what_it_left(reference, tmp_path):
    """`scancel` from outside (an operator, a reservation ending) while a job of 2 checkpoints has scored one: the
    driver reports it with Slurm's state and its log, resubmits the other checkpoint alone, scores nothing twice."""
    run, out, log = _run_of(reference, tmp_path, (8, 16)), tmp_path / "out", tmp_path / "driver.txt"
    with _claim(out, "checkpoint-16") as release, _driving(_args(run, out, "--group-size", "2"), log) as driver:
        [job_id] = _wait(lambda: [j for j in _running(out) if j != "submitting"], 120, "the submission")
        _wait(lambda: _waiting_on_claim(out, job_id, "checkpoint-16"), 240, "checkpoint-8 to be scored")
        first_mtime = (out / "checkpoint-8" / "results.json").stat().st_mtime_ns
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        _wait(lambda: any(r.get("attempt") == 2 for r in _running(out).values()), 120, "the resubmission")
        release()
        assert driver.wait(timeout=300) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert (f"job {job_id} (checkpoint-8, checkpoint-16) failed: ended without a result (Slurm state CANCELLED"
            in text), text
    assert f"log: {out}/jobs/{job_id}_0_log.err; resubmitting what it left unscored once" in text
    assert re.search(r"job \d+ resubmitted: checkpoint-16 \(log: ", text), text
    assert "1 failed" not in text and "2 evaluated" in text
    assert (out / "checkpoint-8" / "results.json").stat().st_mtime_ns == first_mtime  # not scored twice
    assert _table_of(out) == _table_of(reference[1], (8, 16))


@pytest.mark.slow
def test_a_job_past_its_time_limit_is_retried_once_then_recorded(reference, tmp_path):
    """`--time 1`: the job scores its first checkpoint, then waits for the second past its time: Slurm signals the
    end of its time (USR2, 15 s before it runs out for so short a --time) or, signal or not, stops it at the limit;
    its retry (the second checkpoint alone) ends the same way, and the checkpoint becomes an error row naming the
    time limit (exit 1); what the job scored before is kept. With more time the same command completes the table."""
    run, out, log = _run_of(reference, tmp_path, (8, 16)), tmp_path / "out", tmp_path / "driver.txt"
    with _claim(out, "checkpoint-16"), _driving(_args(run, out, "--group-size", "2", "--time", "1"), log) as driver:
        assert driver.wait(timeout=400) == 1, log.read_text()[-3000:]
    text = log.read_text()
    assert text.count("failed: ") >= 2 and "no more retries" in text, text
    assert re.search(r"job \d+ resubmitted: checkpoint-16 \(log: ", text), text
    from nano_eval.sweep.table import read_table

    rows = read_table(out)
    [failed] = {r["error"] for r in rows if r["error"]}
    assert "failed twice" in failed and ("time-limit signal" in failed or "past --time 1 min" in failed), failed
    assert {r["step"] for r in rows if r["error"]} == {16}
    assert _table_of(out, (8,)) == _table_of(reference[1], (8,))

    assert run_main(_args(run, out, "--group-size", "2", "--time", "10")) == 0
    assert _table_of(out) == _table_of(reference[1], (8, 16))


@pytest.mark.slow
def test_watch_submits_new_checkpoints_and_ctrl_c_cancels_the_running_and_the_queued(reference, tmp_path):
    """--watch: each new checkpoint goes out as it appears (two at once: one array, one element at a time). Ctrl-C
    (SIGINT) while one runs and one waits in the queue: both are cancelled (scancel), exit 130, nothing of theirs
    is kept half-done; the command run again (one-shot) scores just those two."""
    run, out, log = _run_of(reference, tmp_path, (8,)), tmp_path / "out", tmp_path / "driver.txt"
    args = _args(run, out, "--watch", "--poll-s", "0.5", "--array-parallelism", "1")
    with _claim(out, "checkpoint-16"):  # held until Slurm has ended both jobs (a job still alive when the claim
        # frees could take it in the moment before scancel's SIGTERM reaches it)
        with _driving(args, log) as driver:
            _wait(lambda: (out / "checkpoint-8" / "results.json").exists(), 240, "checkpoint-8")
            for step in (16, 24):  # written elsewhere, then renamed into place (as trainers save)
                shutil.copytree(reference[0] / f"checkpoint-{step}", tmp_path / f"tmp-{step}")
            for step in (16, 24):
                (tmp_path / f"tmp-{step}").rename(run / f"checkpoint-{step}")
            array = _wait(lambda: next((j.split("_")[0] for j, r in _running(out).items()
                                        if "checkpoint-24" in r["checkpoints"] and "_" in j), None), 120, "the array")
            _wait(lambda: _waiting_on_claim(out, f"{array}_0", "checkpoint-16"), 240, "the job of checkpoint-16")
            assert _queue()[f"{array}_1"][0] == "PENDING"  # --array-parallelism 1
            driver.send_signal(signal.SIGINT)
            assert driver.wait(timeout=120) == 128 + signal.SIGINT, log.read_text()[-3000:]
        text = log.read_text()
        assert f"job {array}_0 cancelled before scoring checkpoint-16" in text, text
        assert f"job {array}_1 cancelled before scoring checkpoint-24" in text, text
        _wait(lambda: all(_queue()[f"{array}_{k}"][0] == "CANCELLED" for k in (0, 1)), 60, "Slurm to cancel both")
    assert _running(out) == {}
    assert not (out / "checkpoint-24" / "results.json").exists()

    with _driving(_args(run, out), tmp_path / "again.txt") as again:
        assert again.wait(timeout=400) == 0, (tmp_path / "again.txt").read_text()[-3000:]
    assert "2 evaluated, 1 reused" in (tmp_path / "again.txt").read_text()
    assert _table_of(out) == _table_of(reference[1], (8, 16, 24))


@contextmanager
def _drained():
    """The node takes no new job while the block runs (`scontrol update State=DRAIN`, as a busy or reserved cluster
    keeps jobs queued): yields a function that puts it back into service, also called at the end."""
    node = subprocess.run(["sinfo", "--noheader", "--format=%N"], capture_output=True, text=True,
                          check=True).stdout.strip()
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=nano_eval test: queued"],
                   check=True, timeout=30)

    def resume():
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=30)

    try:
        yield resume
    finally:
        resume()


@pytest.mark.slow
def test_a_restarted_driver_waits_for_its_queued_array_and_names_a_job_it_cannot_prove(reference, tmp_path):
    """The driver is SIGKILLed while its array waits in the queue (the node drained). The same command again finds
    element 0 by the comment its submission recorded (squeue) and waits for it, pending, instead of submitting its
    checkpoints again. Element 1's comment was changed meanwhile: not provably this sweep's, said in one line, its
    checkpoint submitted anew (the stranger is held, left alone, and cancelled by the test). Then the node comes
    back and the table is the sequential sweep's."""
    run, out = _run_of(reference, tmp_path, (8, 16, 24)), tmp_path / "out"
    args = _args(run, out, "--group-size", "2")
    log = tmp_path / "second.txt"
    array = None
    try:
        with _drained() as resume:
            with _driving(args, tmp_path / "first.txt") as first:
                jobs = _wait(lambda: [j for j in _running(out) if j != "submitting"], 120, "the submission")
                array = jobs[0].split("_")[0]
                first.send_signal(signal.SIGKILL)
                first.wait(timeout=60)
            assert {_queue()[f"{array}_{k}"][0] for k in (0, 1)} == {"PENDING"}
            subprocess.run(["scontrol", "update", f"JobId={array}_1", "Comment=someone-elses"], check=True,
                           timeout=30)
            subprocess.run(["scontrol", "hold", f"{array}_1"], check=True, timeout=30)
            with _driving(args, log) as second:
                _wait(lambda: " submitted: " in log.read_text(), 120, "the new driver to submit checkpoint-24")
                text = log.read_text()
                assert (f"job {array}_0 of an earlier run of this sweep (checkpoint-8, checkpoint-16) is PENDING"
                        in text), text
                assert (f"job {array}_1 of an earlier run (checkpoint-24) is not waited for: its Slurm comment is "
                        "'someone-elses', not the 'nano_eval_sweep:") in text, text
                assert re.findall(r"job \S+ submitted: (.+) \(log", text) == ["checkpoint-24"], text
                resume()
                assert second.wait(timeout=400) == 0, log.read_text()[-3000:]
    finally:
        if array is not None:
            subprocess.run(["scancel", array], timeout=30)
    text = log.read_text()
    assert "3 evaluated, 0 reused" in text, text
    assert _scored_lines(out, f"{array}_0") == ["checkpoint-8", "checkpoint-16"]
    assert len(list((out / "jobs").glob("*_submission.sh"))) == 2  # the first array and the one new job
    assert _table_of(out) == _table_of(reference[1], (8, 16, 24))


@pytest.mark.slow
@pytest.mark.parametrize("in_place", [True, False], ids=["job-files-in-place", "job-files-missing"])
def test_a_driver_killed_inside_sbatch_leaves_jobs_the_next_one_adopts(reference, tmp_path, capsys, monkeypatch,
                                                                       in_place):
    """The driver dies right after sbatch, before it recorded the job ids (here: submitit's submission raises once
    it has submitted, the node drained so that the jobs wait): running.json holds the submission's comment, and the
    restarted driver finds the array by it. Elements whose job file submitit had put in place are waited for, none
    is submitted again; elements without one (the driver died before submitit moved them in) could never run: they
    are cancelled while queued, and their checkpoints submitted anew."""
    import submitit.slurm.slurm as submitit_slurm

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run, out = _run_of(reference, tmp_path, (8, 16)), tmp_path / "out"
    original = submitit_slurm.SlurmExecutor._internal_process_submissions
    seen = {}

    def submits_then_dies(self, delayed):
        jobs = original(self, delayed)
        seen["running"] = json.loads((out / "jobs" / "running.json").read_text())
        if not in_place:
            for job in jobs:
                job.paths.submitted_pickle.unlink()
        raise RuntimeError("the driver died here")

    array = None
    try:
        with _drained() as resume:
            with monkeypatch.context() as patch:
                patch.setattr(submitit_slurm.SlurmExecutor, "_internal_process_submissions", submits_then_dies)
                assert run_main(_args(run, out)) != 0
            assert "the driver died here" in capsys.readouterr().err
            comment = seen["running"]["submitting"]["slurm_comment"]
            array = next(j.split("_")[0] for j, (_, c) in _queue().items() if c == comment)
            # a failing driver clears its record on the way out; a SIGKILLed one leaves it as it was then
            (out / "jobs" / "running.json").write_text(json.dumps(seen["running"]))
            resume()
            assert run_main(_args(run, out)) == 0
    finally:
        if array is not None:
            subprocess.run(["scancel", array], timeout=30)
    printed = capsys.readouterr().out
    assert _table_of(out) == _table_of(reference[1], (8, 16))
    if in_place:
        for k, name in enumerate(("checkpoint-8", "checkpoint-16")):
            assert f"job {array}_{k} of an earlier run of this sweep ({name}; stopped while submitting it)" in printed
        assert "submitted" not in printed.replace("while submitting", "")
        assert len(list((out / "jobs").glob("*_submission.sh"))) == 1
    else:
        assert f"job(s) {array}_0, {array}_1 of an earlier run of this sweep" in printed, printed
        assert "are cancelled (they could not run)" in printed
        assert len(re.findall(r"job \S+ submitted: ", printed)) == 2, printed
        # (squeue lists an array cancelled before any element started under its bare id)
        assert {state for j, (state, _) in _queue().items() if j.split("_")[0] == array} == {"CANCELLED"}


# ---- the cluster's own faults ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_requeued_job_and_a_node_that_goes_down_lose_nothing_and_score_nothing_twice(reference, tmp_path):
    """A job of 2 checkpoints has scored the first. Slurm requeues it (`scontrol requeue`, as a preemption with
    PreemptMode=REQUEUE does); it runs again, reuses the first and waits on the second; then its node goes down
    (`scontrol update State=DOWN`): Slurm kills it and requeues it; the node comes back and the job finishes. The
    driver waited throughout (one submission, no retry), the first checkpoint was scored once, and the table is
    the sequential sweep's. (A requeued job may start again only 2 minutes later, Slurm's rule: the test lets it
    start at once with `scontrol update StartTime=now`, as an operator can.)"""
    run, out, log = _run_of(reference, tmp_path, (8, 16)), tmp_path / "out", tmp_path / "driver.txt"
    node = subprocess.run(["sinfo", "--noheader", "--format=%N"], capture_output=True, text=True,
                          check=True).stdout.strip()

    def restarts(job_id: str) -> int:
        return (out / "jobs" / f"{job_id}_0_log.out").read_text().count("is being scored by another job")

    try:
        with _claim(out, "checkpoint-16") as release, _driving(_args(run, out, "--group-size", "2"), log) as driver:
            [job_id] = _wait(lambda: [j for j in _running(out) if j != "submitting"], 120, "the submission")
            _wait(lambda: _waiting_on_claim(out, job_id, "checkpoint-16"), 240, "checkpoint-8 to be scored")
            first_mtime = (out / "checkpoint-8" / "results.json").stat().st_mtime_ns

            subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
            _wait(lambda: _started_again(job_id), 240, "the requeued job to start again")
            _wait(lambda: restarts(job_id) == 2, 240, "the requeued job to wait on checkpoint-16 again")

            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=nano_eval test"],
                           check=True, timeout=30)
            _wait(lambda: _queue()[job_id][0] != "RUNNING", 60, "Slurm to take the job off the failed node")
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True,
                           timeout=30)  # back at once when its slurmd answers (ReturnToService=2); else now
            _wait(lambda: _started_again(job_id), 240, "the job to start again once the node is back")
            _wait(lambda: restarts(job_id) == 3, 240, "the job to wait on checkpoint-16 a third time")
            release()
            assert driver.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=30)
    text = log.read_text()
    assert "warning" not in text and "resubmitted" not in text and "2 evaluated, 0 reused" in text, text
    assert len(list((out / "jobs").glob("*_submission.sh"))) == 1
    assert _scored_lines(out, job_id) == ["checkpoint-8", "checkpoint-16"]  # over its three runs
    assert (out / "checkpoint-8" / "results.json").stat().st_mtime_ns == first_mtime
    assert _table_of(out) == _table_of(reference[1], (8, 16))


def _started_again(job_id: str) -> bool:
    """Whether requeued job `job_id` runs again. While it waits out Slurm's delay for requeued jobs (BeginTime:
    2 minutes, so that the node is done with the job's earlier run), lets it start now once no step of the earlier
    run is left on the node (a job started again sooner is refused or killed by its own stale steps) and
    slurmctld has had a moment to hear so; repeated, since an update made while the requeue is being completed
    does not stay."""
    state, _ = _queue()[job_id]
    if state == "PENDING":
        if _steps_left(job_id):
            _steps_left.last_seen[job_id] = time.monotonic()
        elif time.monotonic() - _steps_left.last_seen.get(job_id, 0.0) > 3.0:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True,
                           timeout=30)
    return state == "RUNNING"


def _steps_left(job_id: str) -> bool:
    """Whether a slurmstepd of job `job_id` (process title `slurmstepd: [<job id>.<step>]`) still runs here."""
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                title = Path(entry.path, "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(f"slurmstepd: [{job_id}.".encode()):
                return True
    return False


_steps_left.last_seen = {}


# ---- several ranks per job ------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_two_ranks_per_job_score_like_one(reference, tmp_path, capsys, monkeypatch):
    """`--ranks-per-node 2 --device cpu`: srun starts 2 tasks per job; they join one gloo group through submitit's
    TorchDistributedEnvironment (RANK, WORLD_SIZE, MASTER_ADDR from Slurm) and score data-parallel: the table is
    the one-rank sequential sweep's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    run, out = _run_of(reference, tmp_path, (16, 32)), tmp_path / "out"
    assert run_main(_args(run, out, "--ranks-per-node", "2", "--device", "cpu", "--group-size", "2")) == 0
    assert "2 evaluated" in capsys.readouterr().out
    [script] = (out / "jobs").glob("*_submission.sh")
    assert "#SBATCH --ntasks-per-node=2" in script.read_text()
    job_id = script.name.split("_")[0]
    assert "rank 1 of 2" in (out / "jobs" / f"{job_id}_1_log.err").read_text()
    for step in (16, 32):
        ours = json.loads((out / f"checkpoint-{step}" / "results.json").read_text())
        assert ours["layout"]["dp"] == 2, ours["layout"]
    assert _table_of(out) == _table_of(reference[1], (16, 32))
