"""Fan a sweep out as submitit jobs: `nano_eval sweep RUN_DIR --launcher local|slurm [--group-size N]`.

This process is the driver. It plans exactly as the sequential sweep does (runner.SweepRunner: discovery,
selection, settling, evaluation identity, output lock, settings check), then submits one job per group of
`--group-size` checkpoints that still need scoring (a Slurm job array, at most `--array-parallelism` running at
once; `local` runs the same jobs as processes on this machine through submitit's LocalExecutor). Each job runs
worker.run_group: load once per checkpoint, score every task, write `<out>/<checkpoint>/results.json` atomically.

Merge: the driver holds the output folder's lock (lock.py) for the whole sweep; whenever a job ends it reads the
results files of that job's checkpoints (only results carrying the planned evaluation identity count) and rewrites
the table (and, with --watch, the report) -- the same files, built the same way, as the sequential sweep.

What the driver trusts: nothing in the output folder is unpickled or executed by it. submitit's pickles live in
`<out>/jobs`, a folder owned by this user and writable by no one else (private_jobs_dir). A job's outcome comes
from plain JSON only: its status file `<out>/jobs/status/<submission>.json` (worker.status_path; `submission` a
random id the driver gives each job) and each checkpoint's results.json carrying the planned evaluation identity;
submitit's result pickle is never read.

Faults: a job that raises, is killed or cancelled, runs out of time or memory is reported with its log path and
resubmitted once with the checkpoints it left unscored (the ones it finished are not redone); a second failure
records those checkpoints as failed (table `error` column, exit code 1). A job that Slurm requeues (preemption, a
failed node) is PENDING again and simply waited for. Re-running the command reuses every finished checkpoint, so it
is idempotent. SIGINT / SIGTERM cancel the jobs still running or queued (one scancel under Slurm) and keep what they
finished. When a job ended: locally, its controller process ended; under Slurm, submitit's result file appeared or
squeue (slurm.Queue: one call every slurm.QUEUE_POLL_S) says so.

The driver should stay alive while the jobs run (a login-node shell, tmux, or its own small job); if it dies anyway,
the jobs go on, and the next run of the command finds them in `<out>/jobs/running.json` and waits for them, queued
ones too, instead of submitting their checkpoints again -- only jobs it can prove are this sweep's: under Slurm,
squeue lists the job among this user's with the comment running.json recorded for its submission
(slurm.new_comment, given as sbatch --comment); locally, its status file carries the submission id running.json
recorded and its process is a submitit controller of this jobs folder run by this user. running.json is
schema-checked, and one that cannot be read is refused (exit 2) with the file named. Checkpoints (and, under Slurm,
the submission's comment) are recorded there before their jobs are submitted: a driver that dies inside sbatch
leaves what its successor needs to find those jobs (_adopt_submitting); and a job never scores a checkpoint another
job is scoring or has scored (the job holds `<out>/jobs/claims/<checkpoint>.lock` while it decides and scores).
"""

from __future__ import annotations

import math
import os
import secrets
import signal
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nano_eval.errors import NanoEvalError, TasksFailedError
from nano_eval.sweep.runner import SweepOptions, SweepRunner, WorkItem
from nano_eval.sweep.signals import StopFlag
from nano_eval.sweep.worker import CLAIMS_DIR, JOBS_DIR
from nano_eval.local_files import printable

LAUNCHERS = ("local", "slurm")
JOB_POLL_S = {"local": 0.2, "slurm": 2.0}  # how often the driver looks for ended jobs (squeue: slurm.py)
RUNNING_NAME = "running.json"  # <out>/jobs/running.json: the jobs the driver waits for (read by a restarted driver)
SUBMITTING = "submitting"  # running.json's key for the checkpoints of a submission under way (job ids unknown)


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How the jobs are cut and where they run (what they evaluate: the EvalJob)."""

    launcher: str  # "local" | "slurm"
    group_size: int = 1  # checkpoints per job
    partition: str | None = None  # Slurm partition (None: the cluster's default)
    gpus_per_node: int = 1  # one rank (process) per GPU
    ranks_per_node: int | None = None  # processes per node (None: one per GPU, at least one)
    nodes: int = 1
    time_min: int = 60  # per job; Slurm --time, and the local launcher's timeout
    account: str | None = None
    array_parallelism: int = 64  # Slurm: jobs of one array running at once
    dist_timeout_s: float = 1800.0  # collectives between the ranks of one job


def ranks_per_node(o: LaunchOptions) -> int:
    """Processes per node of a job: --ranks-per-node, else one per GPU (at least one). With GPUs, one rank per GPU
    (each rank takes the GPU of its LOCAL_RANK): another count is refused."""
    if o.ranks_per_node is None:
        return max(1, o.gpus_per_node)
    if o.gpus_per_node and o.ranks_per_node != o.gpus_per_node:
        raise NanoEvalError(f"--ranks-per-node {o.ranks_per_node} with --gpus-per-node {o.gpus_per_node}: each rank "
                            "evaluates on its own GPU. Fix: leave out --ranks-per-node (one rank per GPU), or pass "
                            "--gpus-per-node 0 --device cpu for CPU ranks.")
    return o.ranks_per_node


def executor_parameters(o: LaunchOptions) -> dict[str, Any]:
    """The keyword arguments for the submitit executor's update_parameters (SlurmExecutor's are sbatch options;
    the comment that proves a job is this sweep's is set per submission: LaunchedSweep._submit)."""
    ranks = ranks_per_node(o)
    if o.launcher == "slurm":
        # --kill-on-bad-exit: a rank that dies takes the job's other ranks with it, instead of leaving them in a
        # collective until --dist-timeout. signal_delay_s: Slurm's USR2 comes this long before --time runs out
        # (worker.py stops the group on it); submitit's 90 s, or a quarter of a shorter --time, so that a short job
        # is not signalled before its Python has started (the signal would kill it unhandled)
        params: dict[str, Any] = {"job_name": "nano_eval_sweep", "time": o.time_min, "nodes": o.nodes,
                                  "ntasks_per_node": ranks, "array_parallelism": o.array_parallelism,
                                  "srun_args": ["--kill-on-bad-exit=1"], "signal_delay_s": min(90, 15 * o.time_min)}
        if o.gpus_per_node:
            params["gpus_per_node"] = o.gpus_per_node
        if o.partition:
            params["partition"] = o.partition
        if o.account:
            params["account"] = o.account
        return params
    if o.nodes != 1:
        raise NanoEvalError(f"--launcher local runs its jobs on this machine: --nodes {o.nodes} is not possible. "
                            "Fix: --nodes 1, or --launcher slurm.")
    return {"timeout_min": o.time_min, "tasks_per_node": ranks, "gpus_per_node": o.gpus_per_node}


def make_executor(o: LaunchOptions, folder: Path):
    """submitit's SlurmExecutor or LocalExecutor writing into `folder`, with executor_parameters(o)."""
    try:
        import submitit
    except ImportError as e:
        raise NanoEvalError(f"--launcher needs submitit ({e}). Fix: pip install -e '.[cluster]' in the "
                            "nano_eval checkout (or pip install submitit).") from e
    if o.launcher == "slurm":
        try:
            executor = submitit.SlurmExecutor(folder=folder)
        except RuntimeError as e:  # no srun on PATH
            raise NanoEvalError(f"--launcher slurm: {e} Fix: run the sweep on a Slurm login node, or use "
                                "--launcher local.") from e
    else:
        executor = submitit.LocalExecutor(folder=folder)
    executor.update_parameters(**executor_parameters(o))
    return executor


def private_jobs_dir(out: Path) -> Path:
    """`<out>/jobs`, made if missing, as a real folder (no symlink below `out`) owned by this user and writable by
    no one else: submitit keeps its pickles there (the job unpickles its function from it), so no other user may
    put a file there. A folder owned by someone else is refused (exit 2); group / other write bits of our own are
    taken away."""
    from nano_eval.local_files import LocalFileError, real_dir

    folder = real_dir(out / JOBS_DIR, root=out, create=True)
    st = os.lstat(folder)
    if st.st_uid != os.getuid():
        raise LocalFileError(folder, f"belongs to another user (uid {st.st_uid}); submitit's job files there could "
                             "be replaced by them", "remove it, or pass another --output-dir")
    if st.st_mode & 0o022:
        os.chmod(folder, stat.S_IMODE(st.st_mode) & ~0o022)
    return folder


class OrphanLocalJob:
    """A local job whose driver died (its controller process was re-parented), adopted by a restarted driver only
    after `proof` holds. Answers the few questions the driver asks of a submitit Job; never reads its pickles."""

    def __init__(self, folder: Path, job_id: str):
        from submitit.core.utils import JobPaths

        self.folder, self.job_id = folder, job_id
        self.paths = JobPaths(folder, job_id=job_id, task_id=0)

    def proof(self) -> str | None:
        """None when pid `job_id` is a submitit local controller of this very jobs folder, run by this user; else
        why not (the pid ended, or was reused by another program or another user)."""
        try:
            pid = int(self.job_id)
            if pid <= 0:
                return "not a process id"
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                return f"process {pid} belongs to another user"
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            return "no such process"
        if b"submitit.local._local" not in argv:
            return f"process {pid} is not a submitit job"
        folder = argv[argv.index(b"submitit.local._local") + 1] if argv.index(b"submitit.local._local") + 1 < len(
            argv) else b""
        try:
            same = os.path.samefile(os.fsdecode(folder), self.folder)
        except OSError:
            same = False
        return None if same else f"process {pid} is a submitit job of another folder"

    def alive(self) -> bool:
        return self.proof() is None

    @property
    def state(self) -> str:
        return "RUNNING" if self.alive() else "FINISHED"

    def done(self) -> bool:
        return not self.alive()

    def cancel(self, check: bool = True) -> None:
        if self.alive():
            os.kill(int(self.job_id), signal.SIGINT)  # as LocalJob.cancel: the controller stops its tasks


@dataclass
class Submitted:
    job: Any  # a submitit Job (or OrphanLocalJob)
    items: list[WorkItem]
    attempt: int  # 1, then 2 for the retry
    submission: str  # random id given to the job; its status file is worker.status_path(out, submission)
    adopted: dict[str, str] | None = None  # started by an earlier driver: {checkpoint name: identity} it scores
    comment: str | None = None  # Slurm: the sbatch --comment of its submission (slurm.new_comment)
    slurm_state: str | None = None  # Slurm: its state at the last squeue

    @property
    def log(self) -> Path:
        """Rank 0's stderr."""
        return _rank0_paths(self.job).stderr

    @property
    def returned(self) -> bool:
        """submitit wrote rank 0's result file: the job's function returned or raised, nothing more comes from it
        (a job that Slurm requeues, or kills, writes none)."""
        return _rank0_paths(self.job).result_pickle.exists()


def _rank0_paths(job):
    """submitit's file names for rank 0 of `job` (a job of several ranks has no single `paths.stderr`)."""
    from submitit.core.utils import JobPaths

    return JobPaths(job.paths.folder, job_id=str(job.job_id), task_id=0)


class LaunchedSweep(SweepRunner):
    """SweepRunner whose loop submits jobs instead of evaluating in this process. Build once, then `run()`."""

    def __init__(self, job, options: SweepOptions, launch: LaunchOptions):
        from nano_eval.sweep.slurm import Queue

        if launch.launcher not in LAUNCHERS:
            raise NanoEvalError(f"unknown --launcher {launch.launcher!r}. Fix: one of {', '.join(LAUNCHERS)}.")
        super().__init__(job, options)
        if self.world > 1:
            raise NanoEvalError("--launcher runs the driver as one process (the jobs get their own ranks). Fix: "
                                "start `nano_eval sweep ... --launcher ...` without torchrun.")
        executor_parameters(launch)  # bad combinations stop here, before anything is locked or submitted
        self.launch = launch
        self.executor = None
        self.running: list[Submitted] = []
        self.queue = Queue()  # Slurm: this user's jobs as squeue lists them

    def _loop(self, stop: StopFlag) -> None:
        records = self._read_running()  # a malformed record is refused here, before anything is submitted
        self.executor = make_executor(self.launch, private_jobs_dir(self.out))
        self._adopt(records)
        if self.options.watch:
            print(f"nano_eval: watching {printable(str(self.run_dir))} every {self.options.poll_s:g}s; jobs go to "
                  f"--launcher {self.launch.launcher} (stop: Ctrl-C / SIGTERM)", flush=True)
        next_look: float | None = 0.0  # when to look at the run directory again; None: never
        try:
            while not stop.requested:
                if next_look is not None and time.monotonic() >= next_look:
                    next_look = self._plan_round()
                self._collect()
                if next_look is None and not self.running:
                    return
                wait = JOB_POLL_S[self.launch.launcher] if self.running else math.inf
                if next_look is not None:
                    wait = min(wait, max(0.0, next_look - time.monotonic()))
                stop.sleep(wait)
        finally:
            self._cancel_running()

    def _cancel_running(self) -> None:
        """Stopped (or crashed): leave no job behind (queued ones included), keep what they finished."""
        from nano_eval.sweep import slurm

        if self.launch.launcher == "slurm":
            slurm.cancel([str(s.job.job_id) for s in self.running])  # one scancel for all
        else:
            for s in self.running:
                s.job.cancel(check=False)
        for s in self.running:
            left = [i.ckpt.shown for i in s.items if not self._merge(i, s, "cancelled", last_try=False)]
            if left:
                print(f"nano_eval: job {s.job.job_id} cancelled before scoring {', '.join(left)}; rerun the "
                      "command to score them", file=sys.stderr, flush=True)
        self.running = []
        self._write_running()

    def _plan_round(self) -> float | None:
        """Look at the run directory: merge reused checkpoints, submit the others in groups. Returns when to look
        again (None: a one-shot sweep with nothing left to wait for, or --until-step reached)."""
        plan = self._plan(False)
        work, until = plan.work, self.options.until_step
        reached = next((k for k, item in enumerate(work) if until is not None and item.ckpt.step >= until), None)
        if reached is not None:
            work = work[: reached + 1]  # as the sequential sweep: nothing past the first checkpoint at --until-step
        fresh = []
        for item in work:
            self.handled.add(item.ckpt.path)
            adopter = next((s for s in self.running if (s.adopted or {}).get(item.ckpt.name) == item.identity), None)
            if item.reuse or item.blocked is not None:
                self._process(item)  # "already evaluated" (recorded, logged to W&B), or failed: its folder is bad
            elif adopter is not None:
                adopter.items.append(item)  # an earlier driver's job is scoring it: wait for that job
            else:
                fresh.append(item)
        size = self.launch.group_size
        self._submit([fresh[k:k + size] for k in range(0, len(fresh), size)], attempt=1)
        if reached is not None or plan.wait_s is None:
            return None
        return time.monotonic() + plan.wait_s

    def _submit(self, groups: list[list[WorkItem]], attempt: int) -> None:
        from submitit.core.utils import FailedJobError, FailedSubmissionError

        from nano_eval.sweep.slurm import new_comment
        from nano_eval.sweep.worker import run_group

        if not groups:
            return
        jobs, submissions = [], [secrets.token_hex(16) for _ in groups]
        comment = new_comment() if self.launch.launcher == "slurm" else None
        if comment is not None:  # how a restarted driver tells this submission's jobs from any other (slurm.py)
            self.executor.update_parameters(comment=comment)
        # recorded first: a driver killed during the submission leaves this record, and its restarted successor
        # knows that jobs for these checkpoints may exist (worker.claim_checkpoint keeps them from scoring twice;
        # under Slurm it finds them by their comment: _adopt_submitting)
        self._write_running(submitting=(groups, submissions, comment))
        try:
            with self.executor.batch():  # one Slurm array (one sbatch) per round
                for group, submission in zip(groups, submissions):
                    jobs.append(self.executor.submit(run_group, self.job, str(self.run_dir), group,
                                                     self.launch.dist_timeout_s, os.getcwd(), submission))
        except (FailedJobError, FailedSubmissionError) as e:  # sbatch said no: bad partition, account, limits
            what = " ".join(str(e).split())[:1000]
            raise NanoEvalError(f"the jobs for {', '.join(i.ckpt.shown for group in groups for i in group)} could "
                                f"not be submitted: {printable(what)}. Fix: check --slurm-partition, --account, "
                                "--time, --nodes and --gpus-per-node against what the cluster offers (`sinfo`, "
                                "`sacctmgr show assoc user=$USER`); finished checkpoints are kept.") from None
        self.queue.refresh()  # the next look at the queue is newer than these jobs
        for job, group, submission in zip(jobs, groups, submissions):
            self.running.append(Submitted(job, group, attempt, submission, comment=comment))
            log = printable(str(_rank0_paths(job).stderr))
            print(f"nano_eval: job {job.job_id} {'resubmitted' if attempt > 1 else 'submitted'}: "
                  f"{', '.join(i.ckpt.shown for i in group)} (log: {log})", flush=True)
        self._write_running()

    def _write_running(self, submitting: tuple[list[list[WorkItem]], list[str], str | None] | None = None) -> None:
        """Record the jobs being waited for, so a driver restarted after this one died waits for them instead of
        scoring their checkpoints a second time; `submitting`: (groups, their submission ids, the Slurm comment) of
        jobs being submitted now (their ids are not known yet), recorded under the key SUBMITTING until the next
        call."""
        from nano_eval.tracking.files import write_json

        records = {}
        for s in self.running:
            records[str(s.job.job_id)] = {
                "launcher": self.launch.launcher, "attempt": s.attempt, "submission": s.submission,
                "checkpoints": {i.ckpt.name: i.identity for i in s.items} | (s.adopted or {}),
                **({"slurm_comment": s.comment} if s.comment else {})}
        if submitting is not None:
            groups, submissions, comment = submitting
            records[SUBMITTING] = {"launcher": self.launch.launcher,
                                   "checkpoints": {i.ckpt.name: i.identity for group in groups for i in group},
                                   "groups": [[i.ckpt.name for i in group] for group in groups],
                                   "submissions": submissions, **({"slurm_comment": comment} if comment else {})}
        write_json(self.out / JOBS_DIR / RUNNING_NAME, records, root=self.out)

    def _read_running(self) -> dict[str, dict]:
        """`<out>/jobs/running.json`, checked against its schema ({} when missing). It decides which jobs this
        driver waits for, so one that cannot be read is refused (exit 2) rather than guessed at or overwritten."""
        from nano_eval.local_files import LocalFileError, read_json

        path = self.out / JOBS_DIR / RUNNING_NAME
        try:
            records = read_json(path, root=self.out)
            for job_id, record in records.items():
                why = _running_record_problem(job_id, record)
                if why is not None:
                    raise LocalFileError(path, f"has a bad record for job {job_id!r}: {why}", "")
        except FileNotFoundError:
            return {}
        except LocalFileError as e:
            raise NanoEvalError(f"cannot use {printable(str(path))}: it {printable(e.what)}. Fix: make sure no job "
                                f"of an earlier sweep into {printable(str(self.out))} is still running (their logs "
                                "are next to it), then delete it and rerun (finished checkpoints are reused).") \
                from None
        return records

    def _adopt(self, records: dict[str, dict]) -> None:
        """Follow the jobs an earlier driver of this folder left running or queued (it was killed, or its login
        shell ended), so that its death never costs a second allocation.

        A job is adopted only with proof that this sweep submitted it, never from a job id or pid alone, and
        nothing of the job's is unpickled. Slurm: squeue lists it among this user's jobs, not ended, with the
        comment running.json recorded for its submission (pending jobs too: they have written nothing yet).
        Local: its own status file (plain JSON, in the private jobs folder) carries the submission id running.json
        recorded and says it is running, and its process is a submitit controller of this jobs folder run by this
        user. A job without proof is not waited for (said in one line): its checkpoints are planned again (a job
        still scoring one holds its claim, so nothing is scored twice)."""
        mine = {job_id: record for job_id, record in records.items() if record["launcher"] == self.launch.launcher}
        if not mine:
            return
        queued = None
        if self.launch.launcher == "slurm":
            from nano_eval.sweep.slurm import list_jobs

            try:
                queued = list_jobs()
            except NanoEvalError as e:  # waiting or submitting blind could spend an allocation twice
                raise NanoEvalError(f"the jobs an earlier run of this sweep recorded in "
                                    f"{printable(str(self.out / JOBS_DIR / RUNNING_NAME))} cannot be looked up: "
                                    f"{e}") from None
        for job_id, record in mine.items():
            names = printable(", ".join(record["checkpoints"]))
            if job_id == SUBMITTING:
                self._adopt_submitting(record, queued)
                continue
            if queued is not None:
                job, why = self._slurm_proof(job_id, record, queued)
            else:
                job = OrphanLocalJob(self.out / JOBS_DIR, job_id)
                why = job.proof() or self._status_proof(job_id, record)
                if why is None and job.done():
                    why = "it has ended"
            if why is not None:
                print(f"nano_eval: job {printable(job_id)} of an earlier run ({names}) is not waited for: {why}; its "
                      "checkpoints are planned again (those already scored are reused)", flush=True)
                continue
            self.running.append(Submitted(job, [], record.get("attempt", 1), record["submission"],
                                          adopted=record["checkpoints"], comment=record.get("slurm_comment")))
            where = queued[job_id].describe() if queued is not None else "still running"
            print(f"nano_eval: job {job_id} of an earlier run of this sweep ({names}) is {where}: waiting for it "
                  "instead of submitting them again", flush=True)

    def _status_proof(self, job_id: str, record: dict) -> str | None:
        """None when the job's own status file carries the submission running.json recorded and says it runs."""
        from nano_eval.local_files import LocalFileError, read_json
        from nano_eval.sweep.worker import status_path

        try:
            status = read_json(status_path(self.out, record["submission"]), root=self.out)
        except FileNotFoundError:
            return "it has not started (no status file)"
        except LocalFileError as e:
            return printable(e.what)
        if status.get("submission") != record["submission"] or str(status.get("job_id")) != job_id:
            return "its status file names another job"
        if status.get("state") != "running":
            return f"it says it is {printable(str(status.get('state')))}"
        return None

    def _slurm_proof(self, job_id: str, record: dict, queued: dict) -> tuple[Any, str | None]:
        """(submitit's SlurmJob for `job_id`, None) when squeue proves it is this sweep's and not ended; else
        (None, why not)."""
        import submitit

        found = queued.get(job_id)
        if record.get("slurm_comment") is None:
            return None, "its record has no Slurm comment to check it by (written by an older nano_eval)"
        if found is None:
            return None, "squeue lists no such job of yours (it ended a while ago, or the cluster was reset)"
        if found.comment != record["slurm_comment"]:
            return None, (f"its Slurm comment is {printable(found.comment)[:100]!r}, not the "
                          f"{record['slurm_comment']!r} this sweep gave it: not provably this sweep's job")
        if found.ended:
            return None, f"Slurm says it ended ({found.state})"
        return submitit.SlurmJob(folder=self.out / JOBS_DIR, job_id=job_id), None

    def _adopt_submitting(self, record: dict, queued: dict | None) -> None:
        """An earlier driver died while submitting the groups of `record`. Under Slurm its jobs are found by the
        submission's comment: one whose pickle submitit had put in place is adopted (array element i scores
        group i); one without it could only fail (submitit waits 60 s for it), so it is cancelled while it costs
        nothing. Locally (no queue to ask) a job submitted for the same checkpoint waits for it and reuses its
        results (lock files in `<out>/jobs/claims`), so nothing is scored twice."""
        import submitit
        from submitit.core.utils import JobPaths

        from nano_eval.sweep.slurm import cancel

        names = printable(", ".join(record["checkpoints"]))
        comment, groups = record.get("slurm_comment"), record.get("groups") or []
        found = sorted(j for j, q in (queued or {}).items() if comment and q.comment == comment and not q.ended)
        if not found:
            print(f"nano_eval: warning: an earlier run of this sweep was stopped while submitting jobs for {names}; "
                  + ("Slurm lists none of them, so they are submitted now" if queued is not None else
                     "if any of them started, the job submitted now for the same checkpoint waits for it and reuses "
                     f"its results (lock files in {self.out / JOBS_DIR / CLAIMS_DIR}), so nothing is scored twice"),
                  flush=True)
            return
        useless = []
        for job_id in found:
            index = int(job_id.split("_")[1]) if "_" in job_id else 0
            pickle = JobPaths(self.out / JOBS_DIR, job_id=job_id).submitted_pickle
            if index >= len(groups) or not pickle.exists():
                useless.append(job_id)
                continue
            adopted = {name: record["checkpoints"][name] for name in groups[index] if name in record["checkpoints"]}
            self.running.append(Submitted(submitit.SlurmJob(folder=self.out / JOBS_DIR, job_id=job_id), [], 1,
                                          record["submissions"][index], adopted=adopted, comment=comment))
            print(f"nano_eval: job {job_id} of an earlier run of this sweep ({printable(', '.join(adopted))}; "
                  f"stopped while submitting it) is {queued[job_id].describe()}: waiting for it", flush=True)
        if useless:
            cancel(useless)
            print(f"nano_eval: job(s) {', '.join(useless)} of an earlier run of this sweep, stopped while submitting "
                  "them before their job files were in place, are cancelled (they could not run); their "
                  "checkpoints are submitted again", flush=True)

    # ---- merge (this process holds the output lock) ---------------------------------------------------------------

    def _collect(self) -> None:
        """Merge every job that ended since the last look; resubmit (once) what a failed job left unscored."""
        from nano_eval.sweep.report import write_report
        from nano_eval.sweep.table import write_table

        ended = self._ended()
        for s in ended:
            self.running.remove(s)
            error = self._outcome(s)
            if error is not None:
                again = "resubmitting what it left unscored once" if s.attempt == 1 else "no more retries"
                print(f"nano_eval: warning: job {s.job.job_id} ({', '.join(i.ckpt.shown for i in s.items)}) failed: "
                      f"{printable(str(error))}; log: {printable(str(s.log))}; {again}", file=sys.stderr, flush=True)
            retry = []
            for item in s.items:
                if not self._merge(item, s, error, last_try=s.attempt > 1):
                    retry.append(item)
            self._submit([retry] if retry else [], attempt=s.attempt + 1)
        if ended:
            self._write_running()
        if ended and (self.summary.done or self.summary.failed):
            write_table(self.summary.done, self.out, self.summary.failed)
            if self.options.watch and self.options.report:
                write_report(self.out)

    def _ended(self) -> list[Submitted]:
        """The jobs that will do nothing more. Local: the controller process ended. Slurm: submitit's result file
        is there (looked for at every poll, for the jobs squeue did not last see PENDING), or squeue (asked every
        slurm.QUEUE_POLL_S) says the job ended or no longer lists it; a job Slurm requeued (preempted, its node
        failed) is PENDING again and still waited for. While squeue does not answer, no job counts as ended."""
        if self.launch.launcher != "slurm":
            return [s for s in self.running if s.job.done()]
        ended = [s for s in self.running if s.slurm_state != "PENDING" and s.returned]
        if len(ended) == len(self.running):
            return ended
        queued = self.queue.jobs()
        if queued is None:
            return ended
        for s in self.running:
            found = queued.get(str(s.job.job_id))
            s.slurm_state = found.state if found is not None else s.slurm_state
            if s not in ended and (found is None or found.ended):
                ended.append(s)
        return ended

    def _outcome(self, s: Submitted) -> str | None:
        """None when the job ended well, else one line saying why it failed, from the job's own status file (plain
        JSON; submitit's result pickle is never read). What it finished is read from the checkpoints' results."""
        from nano_eval.local_files import LocalFileError, read_json
        from nano_eval.sweep.worker import status_path

        try:
            doc = read_json(status_path(self.out, s.submission), root=self.out)
        except FileNotFoundError:
            return self._killed(s)
        except LocalFileError as e:
            return f"its status file cannot be used: {e.what}"
        if doc.get("submission") != s.submission or not isinstance(doc.get("checkpoints"), dict):
            return "its status file is not the one it wrote"
        if doc.get("state") == "done":
            return None
        if doc.get("state") == "failed":
            return " ".join(str(doc.get("error") or "failed").split())[:2000]
        return self._killed(s)

    def _killed(self, s: Submitted) -> str:
        """Why a job that wrote no final status ended, as far as its launcher knows."""
        if self.launch.launcher == "slurm":
            from nano_eval.sweep.slurm import ENDED, final_state

            state = s.slurm_state if s.slurm_state in ENDED else (final_state(str(s.job.job_id)) or s.slurm_state)
            return (f"ended without a result (Slurm state {state or 'unknown'}: cancelled, preempted, its node "
                    f"failed, out of memory or past --time {self.launch.time_min} min?)")
        return (f"ended without a result (state {s.job.state}: killed, out of memory or past --time "
                f"{self.launch.time_min} min?)")

    def _merge(self, item: WorkItem, s: Submitted, error: str | None, last_try: bool) -> bool:
        """Record one checkpoint of an ended job; False when it must be tried again. Its results count as evaluated
        by this sweep even when the job found them written (by its own earlier run, before Slurm requeued it, or by
        another job of this sweep): they were not there when the sweep planned."""
        from nano_eval.local_files import LocalFileError
        from nano_eval.tracking.results import read_results

        path = self.out / item.ckpt.name / "results.json"
        try:
            doc = read_results(path, root=self.out)
        except (OSError, LocalFileError):
            doc = {}
        written = (doc.get("sweep") or {}).get("evaluation_identity") == item.identity
        if written and not doc.get("failed_tasks"):
            self.summary.done[item.ckpt.step] = path
            self.summary.evaluated.append(item.ckpt.name)
            print(f"nano_eval: {item.ckpt.shown} (step {item.ckpt.step}): evaluated (job {s.job.job_id})", flush=True)
            self._after_merge(item, path)
            return True
        if not last_try:
            return False
        if written:  # scored, but some tasks failed twice: kept with an error row, as the sequential sweep does
            self.summary.done[item.ckpt.step] = path
            failed = "; ".join(f"{k}: {why}" for k, why in doc["failed_tasks"].items())
            self._record_failure(item, TasksFailedError(f"task(s) failed while being scored: {failed} (job "
                                                        f"{s.job.job_id}, log: {s.log})"))
            self._after_merge(item, path)
        else:
            self._record_failure(item, NanoEvalError(f"job {s.job.job_id} failed twice: {error or 'no results'}; "
                                                     f"log: {s.log}"))
        return True

    def _after_merge(self, item: WorkItem, path: Path) -> None:
        if self.wandb is not None:  # items merged here were scored by this sweep's jobs (reused ones: _process)
            self._log_wandb(path)
        if self.after_checkpoint is not None:
            self.after_checkpoint(item.ckpt, False)


def _running_record_problem(job_id, record) -> str | None:
    """Why a record of running.json is not one this driver wrote, or None."""
    from nano_eval.sweep.slurm import is_comment

    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("launcher") not in LAUNCHERS:
        return "no known launcher"
    checkpoints = record.get("checkpoints")
    if not isinstance(checkpoints, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in checkpoints.items()):
        return "`checkpoints` must map checkpoint names to evaluation identities"
    if "slurm_comment" in record and not is_comment(record["slurm_comment"]):
        return "`slurm_comment` must be the nano_eval_sweep:<16 hex digits> the driver gave the submission"
    if job_id == SUBMITTING:
        groups, submissions = record.get("groups", []), record.get("submissions", [])
        if not (isinstance(groups, list) and all(isinstance(g, list) and all(isinstance(n, str) for n in g)
                                                 for g in groups)):
            return "`groups` must be lists of checkpoint names"
        if not (isinstance(submissions, list) and len(submissions) == len(groups)
                and all(_is_submission(x) for x in submissions)):
            return "`submissions` must be one 32-digit hex id per group"
        return None
    if not (job_id.replace("_", "").isdigit() and len(job_id) < 40):
        return "the job id is not a number"
    if not isinstance(record.get("attempt"), int) or isinstance(record.get("attempt"), bool):
        return "`attempt` must be an integer"
    if not _is_submission(record.get("submission")):
        return "`submission` must be the 32-digit hex id the driver gave the job"
    return None


def _is_submission(text: object) -> bool:
    return isinstance(text, str) and len(text) == 32 and all(c in "0123456789abcdef" for c in text)
