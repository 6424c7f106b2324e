"""What Slurm itself says about this user's jobs, for the sweep driver (launch.py, `--launcher slurm`).

The driver asks `squeue` (slurmctld's own job table: pending, running, requeued and recently ended jobs) rather
than reading anything a job wrote: whether a job still runs or waits in the queue, and whether a job listed in
`<out>/jobs/running.json` by an earlier driver is this sweep's. A job is this sweep's when squeue lists it among
this user's jobs with the comment the driver gave its submission (`sbatch --comment=nano_eval_sweep:<random hex>`,
recorded in running.json before the submission): a job id alone proves nothing (ids are reused after a cluster is
reset, and a record can be copied from another folder). One squeue call answers for all jobs at once, at most
every QUEUE_POLL_S seconds per driver, so a sweep of hundreds of jobs costs the controller one query per poll.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import time
from dataclasses import dataclass

from nano_eval.errors import NanoEvalError

QUEUE_POLL_S = 10.0  # how often the driver asks squeue (a job's result file is looked for every JOB_POLL_S)
COMMAND_TIMEOUT_S = 60.0
COMMENT_PREFIX = "nano_eval_sweep:"
# States after which a job does nothing more (squeue's %T). A requeued job is PENDING again (REQUEUED while it
# is cleaned up), a suspended or held one may still run: those are waited for.
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "REVOKED", "TIMEOUT"})
_COMMENT = re.compile(re.escape(COMMENT_PREFIX) + r"[0-9a-f]{16}")


def new_comment() -> str:
    """A fresh `nano_eval_sweep:<16 hex digits>` for one submission (one sbatch: a job, or a whole array)."""
    return COMMENT_PREFIX + secrets.token_hex(8)


def is_comment(text: object) -> bool:
    return isinstance(text, str) and _COMMENT.fullmatch(text) is not None


@dataclass(frozen=True)
class QueuedJob:
    """One job (or array element: `<array id>_<index>`) as squeue lists it."""

    job_id: str
    state: str  # PENDING, RUNNING, COMPLETING, CANCELLED, ...
    reason: str  # why it waits (Priority, Resources, JobHeldUser, BeginTime, ...) or None
    comment: str

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self) -> str:
        """`PENDING (Priority)`, `RUNNING`: for messages."""
        return self.state + (f" ({self.reason})" if self.state == "PENDING" and self.reason not in ("", "None")
                             else "")


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NanoEvalError(f"`{' '.join(argv)}` failed: {e}. Fix: run the sweep where Slurm's commands answer "
                            "(a login node).") from None
    if done.returncode != 0:
        raise NanoEvalError(f"`{' '.join(argv)}` failed (exit {done.returncode}): "
                            f"{' '.join(done.stderr.split())[:500]}. Fix: run the sweep where Slurm's commands "
                            "answer (a login node); if slurmctld is down, wait for it.")
    return done.stdout


def list_jobs() -> dict[str, QueuedJob]:
    """Every job of this user that slurmctld still knows (running, pending, and those ended within MinJobAge),
    array elements one per line. Raises NanoEvalError when squeue does not answer."""
    out = _run(["squeue", "--noheader", "--array", "--states=all", f"--user={os.getuid()}",
                "--format=%i|%T|%r|%k"])
    jobs = {}
    for line in out.splitlines():
        parts = line.split("|", 3)  # the comment comes last: it may hold '|'
        if len(parts) == 4:
            jobs[parts[0].strip()] = QueuedJob(parts[0].strip(), parts[1].strip(), parts[2].strip(), parts[3])
    return jobs


def final_state(job_id: str) -> str | None:
    """What the accounting database (sacct) says a job ended as, for a job squeue no longer lists; None if it does
    not answer."""
    try:
        out = _run(["sacct", "--noheader", "--parsable2", "--allocations", "--format=JobID,State", "-j", job_id])
    except NanoEvalError:
        return None
    for line in out.splitlines():
        found, _, state = line.partition("|")
        if found == job_id and state:
            return state.split()[0]  # "CANCELLED by 0" -> CANCELLED
    return None


def cancel(job_ids: list[str]) -> None:
    """scancel these jobs (one call); what fails is said, never raised: the driver is stopping anyway."""
    if not job_ids:
        return
    try:
        _run(["scancel", *job_ids])
    except NanoEvalError as e:
        import sys

        print(f"nano_eval: warning: {e}", file=sys.stderr, flush=True)


class Queue:
    """This user's jobs as squeue lists them, asked again at most every QUEUE_POLL_S seconds (or at once after
    `refresh()`, e.g. after a submission, so a job just submitted is never missed)."""

    def __init__(self, every_s: float = QUEUE_POLL_S):
        self.every_s = every_s
        self._jobs: dict[str, QueuedJob] | None = None
        self._asked = -float("inf")
        self._failing = False

    def refresh(self) -> None:
        self._asked = -float("inf")

    def jobs(self) -> dict[str, QueuedJob] | None:
        """The last listing (asked again when it is older than every_s); None while squeue does not answer (said
        once, on stderr, until it answers again: the driver then waits, it does not guess)."""
        import sys

        if time.monotonic() - self._asked >= self.every_s:
            self._asked = time.monotonic()
            try:
                self._jobs = list_jobs()
                if self._failing:
                    print("nano_eval: squeue answers again", file=sys.stderr, flush=True)
                self._failing = False
            except NanoEvalError as e:
                if not self._failing:
                    print(f"nano_eval: warning: {e} The jobs are assumed to be still running; asking again every "
                          f"{self.every_s:g}s.", file=sys.stderr, flush=True)
                self._jobs, self._failing = None, True
        return self._jobs
