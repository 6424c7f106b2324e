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

Faults: a job that raises, is killed, runs out of time or memory is reported with its log path and resubmitted
once with the checkpoints it left unscored (the ones it finished are not redone); a second failure records those
checkpoints as failed (table `error` column, exit code 1). Re-running the command reuses every finished
checkpoint, so it is idempotent. SIGINT / SIGTERM cancel the jobs still running (scancel under Slurm) and keep
what they finished. The driver should stay alive while the jobs run (a login-node shell, tmux, or its own small
job); if it dies anyway, the jobs go on, and the next run of the command finds them in `<out>/jobs/running.json`
and waits for them instead of scoring their checkpoints a second time -- only jobs it can prove are this sweep's
(their status file carries the submission id running.json recorded, and a local job's process is a submitit
controller of this jobs folder run by this user); running.json is schema-checked, and one that cannot be read is
refused (exit 2) with the file named. Checkpoints are recorded there before their jobs are submitted; should the
driver die during a submission, a job never scores a checkpoint another job is scoring or has scored (the job holds
`<out>/jobs/claims/<checkpoint>.lock` while it decides and scores).
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
JOB_POLL_S = {"local": 0.2, "slurm": 10.0}  # how often the driver asks whether a job ended
RUNNING_NAME = "running.json"  # <out>/jobs/running.json: the jobs the driver waits for (read by a restarted driver)
SUBMITTING = "submitting"  # running.json's key for the checkpoints of a submission under way (job ids unknown)


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """How the jobs are cut and where they run (what they evaluate: the EvalJob)."""

    launcher: str  # "local" | "slurm"
    group_size: int = 1  # checkpoints per job
    partition: str | None = None  # Slurm partition (None: the cluster's default)
    gpus_per_node: int = 1  # one rank (process) per GPU
    nodes: int = 1
    time_min: int = 60  # per job; Slurm --time, and the local launcher's timeout
    account: str | None = None
    array_parallelism: int = 64  # Slurm: jobs of one array running at once
    dist_timeout_s: float = 1800.0  # collectives between the ranks of one job


def executor_parameters(o: LaunchOptions) -> dict[str, Any]:
    """The keyword arguments for the submitit executor's update_parameters (SlurmExecutor's are sbatch options)."""
    ranks_per_node = max(1, o.gpus_per_node)
    if o.launcher == "slurm":
        params: dict[str, Any] = {"job_name": "nano_eval_sweep", "time": o.time_min, "nodes": o.nodes,
                                  "ntasks_per_node": ranks_per_node, "array_parallelism": o.array_parallelism}
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
    return {"timeout_min": o.time_min, "tasks_per_node": ranks_per_node, "gpus_per_node": o.gpus_per_node}


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

    @property
    def log(self) -> Path:
        return Path(self.job.paths.stderr)


class LaunchedSweep(SweepRunner):
    """SweepRunner whose loop submits jobs instead of evaluating in this process. Build once, then `run()`."""

    def __init__(self, job, options: SweepOptions, launch: LaunchOptions):
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
            for s in self.running:  # stopped (or crashed): leave no job behind, keep what it finished
                s.job.cancel(check=False)
                left = [i.ckpt.shown for i in s.items if not self._merge(i, None, s, "cancelled", last_try=False)]
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
        from nano_eval.sweep.worker import run_group

        if not groups:
            return
        jobs, submissions = [], []
        # recorded first: a driver killed during the submission leaves this record, and its restarted successor
        # knows that jobs for these checkpoints may exist (worker.claim_checkpoint keeps them from scoring twice)
        self._write_running(submitting=[i for group in groups for i in group])
        with self.executor.batch():  # one Slurm array (one sbatch) per round
            for group in groups:
                submissions.append(secrets.token_hex(16))
                jobs.append(self.executor.submit(run_group, self.job, str(self.run_dir), group,
                                                 self.launch.dist_timeout_s, os.getcwd(), submissions[-1]))
        for job, group, submission in zip(jobs, groups, submissions):
            self.running.append(Submitted(job, group, attempt, submission))
            print(f"nano_eval: job {job.job_id} {'resubmitted' if attempt > 1 else 'submitted'}: "
                  f"{', '.join(i.ckpt.shown for i in group)} (log: {printable(str(job.paths.stderr))})", flush=True)
        self._write_running()

    def _write_running(self, submitting: list[WorkItem] = ()) -> None:
        """Record the jobs being waited for, so a driver restarted after this one died waits for them instead of
        scoring their checkpoints a second time; `submitting`: checkpoints whose jobs are being submitted now (their
        ids are not known yet), recorded under the key SUBMITTING until the next call."""
        from nano_eval.tracking.files import write_json

        records = {
            str(s.job.job_id): {"launcher": self.launch.launcher, "attempt": s.attempt, "submission": s.submission,
                                "checkpoints": {i.ckpt.name: i.identity for i in s.items} | (s.adopted or {})}
            for s in self.running}
        if submitting:
            records[SUBMITTING] = {"launcher": self.launch.launcher,
                                   "checkpoints": {i.ckpt.name: i.identity for i in submitting}}
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
        """Follow the jobs an earlier driver of this folder left running (it was killed, or its login shell ended).

        A job is adopted only with proof that this sweep submitted it: its own status file (plain JSON, in the
        private jobs folder) carries the submission id running.json recorded for it and says it is running, and,
        for the local launcher, its process is a submitit controller of this jobs folder run by this user. Never
        from a pid alone; nothing of the job's is unpickled. A job without proof is not waited for: its
        checkpoints are planned again (a job still scoring one holds its claim, so nothing is scored twice)."""
        from nano_eval.local_files import LocalFileError, read_json
        from nano_eval.sweep.worker import status_path

        for job_id, record in records.items():
            if record["launcher"] != self.launch.launcher:
                continue
            names = printable(", ".join(record["checkpoints"]))
            if job_id == SUBMITTING:
                print(f"nano_eval: warning: an earlier run of this sweep was stopped while submitting jobs for "
                      f"{names}; if any of them started, the job submitted now for the same checkpoint waits for it "
                      f"and reuses its results (lock files in {self.out / JOBS_DIR / CLAIMS_DIR}), so nothing is "
                      "scored twice", flush=True)
                continue
            if self.launch.launcher == "local":
                job = OrphanLocalJob(self.out / JOBS_DIR, job_id)
            else:
                import submitit

                job = submitit.SlurmJob(folder=self.out / JOBS_DIR, job_id=job_id)
            why = job.proof() if isinstance(job, OrphanLocalJob) else None
            if why is None:
                try:
                    status = read_json(status_path(self.out, record["submission"]), root=self.out)
                    if status.get("submission") != record["submission"] or str(status.get("job_id")) != job_id:
                        why = "its status file names another job"
                    elif status.get("state") != "running":
                        why = f"it says it is {printable(str(status.get('state')))}"
                except FileNotFoundError:
                    why = "it has not started (no status file)"
                except LocalFileError as e:
                    why = printable(e.what)
            if why is None and job.done():
                why = "it has ended"
            if why is not None:
                print(f"nano_eval: job {printable(job_id)} of an earlier run ({names}) is not waited for: {why}; its "
                      "checkpoints are planned again", flush=True)
                continue
            self.running.append(Submitted(job, [], record.get("attempt", 1), record["submission"],
                                          adopted=record["checkpoints"]))
            print(f"nano_eval: job {job_id} of an earlier run of this sweep is still running "
                  f"({names}): waiting for it instead of submitting them again", flush=True)

    # ---- merge (this process holds the output lock) ---------------------------------------------------------------

    def _collect(self) -> None:
        """Merge every job that ended since the last look; resubmit (once) what a failed job left unscored."""
        from nano_eval.sweep.report import write_report
        from nano_eval.sweep.table import write_table

        ended = [s for s in self.running if s.job.done()]
        for s in ended:
            self.running.remove(s)
            status, error = self._outcome(s)
            if error is not None:
                again = "resubmitting what it left unscored once" if s.attempt == 1 else "no more retries"
                print(f"nano_eval: warning: job {s.job.job_id} ({', '.join(i.ckpt.shown for i in s.items)}) failed: "
                      f"{printable(str(error))}; log: {printable(str(s.log))}; {again}", file=sys.stderr, flush=True)
            retry = []
            for item in s.items:
                if not self._merge(item, status.get(item.ckpt.name), s, error, last_try=s.attempt > 1):
                    retry.append(item)
            self._submit([retry] if retry else [], attempt=s.attempt + 1)
        if ended:
            self._write_running()
        if ended and (self.summary.done or self.summary.failed):
            write_table(self.summary.done, self.out, self.summary.failed)
            if self.options.watch and self.options.report:
                write_report(self.out)

    def _outcome(self, s: Submitted) -> tuple[dict[str, str], str | None]:
        """(the job's {checkpoint: "evaluated" | "reused"}, None) or ({...what it finished}, one line saying why the
        job failed), from the job's own status file (plain JSON; submitit's result pickle is never read)."""
        from nano_eval.local_files import LocalFileError, read_json
        from nano_eval.sweep.worker import status_path

        killed = (f"ended without a result (state {s.job.state}: killed, out of memory or past --time "
                  f"{self.launch.time_min} min?)")
        try:
            doc = read_json(status_path(self.out, s.submission), root=self.out)
        except FileNotFoundError:
            return {}, killed
        except LocalFileError as e:
            return {}, f"its status file cannot be used: {e.what}"
        checkpoints = doc.get("checkpoints")
        if doc.get("submission") != s.submission or not isinstance(checkpoints, dict):
            return {}, "its status file is not the one it wrote"
        status = {k: v for k, v in checkpoints.items() if v in ("evaluated", "reused")}
        if doc.get("state") == "done":
            return status, None
        if doc.get("state") == "failed":
            return status, " ".join(str(doc.get("error") or "failed").split())[:2000]
        return status, killed

    def _merge(self, item: WorkItem, status: str | None, s: Submitted, error: str | None, last_try: bool) -> bool:
        """Record one checkpoint of an ended job; False when it must be tried again."""
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
            (self.summary.reused if status == "reused" else self.summary.evaluated).append(item.ckpt.name)
            print(f"nano_eval: {item.ckpt.shown} (step {item.ckpt.step}): "
                  f"{'already evaluated' if status == 'reused' else 'evaluated'} (job {s.job.job_id})", flush=True)
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
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("launcher") not in LAUNCHERS:
        return "no known launcher"
    checkpoints = record.get("checkpoints")
    if not isinstance(checkpoints, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in checkpoints.items()):
        return "`checkpoints` must map checkpoint names to evaluation identities"
    if job_id == SUBMITTING:
        return None
    if not (job_id.replace("_", "").isdigit() and len(job_id) < 40):
        return "the job id is not a number"
    if not isinstance(record.get("attempt"), int) or isinstance(record.get("attempt"), bool):
        return "`attempt` must be an integer"
    submission = record.get("submission")
    if not (isinstance(submission, str) and len(submission) == 32
            and all(c in "0123456789abcdef" for c in submission)):
        return "`submission` must be the 32-digit hex id the driver gave the job"
    return None
