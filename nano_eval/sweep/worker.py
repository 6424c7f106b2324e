"""What one launcher job runs (`--launcher local|slurm`): evaluate a group of checkpoints in the job's own
process(es), each exactly as the sequential sweep would, each written atomically to `<out>/<checkpoint>/`.

submitit pickles `run_group` and its arguments (into `<out>/jobs/`, a folder the driver makes private to its user:
launch.private_jobs_dir) and starts the job (a local process, or an sbatch job whose `srun` starts one process per
GPU). The driver learns the outcome from plain JSON, never from submitit's result pickle: the job's status file
(`status_path`) and each checkpoint's results.json with the evaluation identity.

With several tasks in a job (`--nodes` x `--gpus-per-node`) each task is one rank: submitit's TorchDistributedEnvironment gives it RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT, the ranks join one process group and evaluate each checkpoint data-parallel (or in the
`--backend nanotron --tp --pp` layout), as under torchrun; rank 0 writes.

A checkpoint whose results file already has the item's evaluation identity is not evaluated again (a retried or
repeated job redoes nothing); rank 0 reads the file and broadcasts the decision, so the job's ranks always agree. A
checkpoint that fails is recorded and the group goes on; the job then raises (`GroupFailed`), so the launcher sees a
failed job, names its log and retries it once.

Limitation (as in the sequential sweep): an error on only some ranks of a job leaves the others waiting in a
collective until --dist-timeout; then they fail too and the job counts as failed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from nano_eval.errors import is_rust_panic
from nano_eval.job import EvalJob
from nano_eval.sweep.runner import WorkItem, evaluate_item, finished_identity, free_memory
from nano_eval.tracking.wandb_logger import one_line
from nano_eval.local_files import printable

JOBS_DIR = "jobs"  # <out>/jobs/: submitit's pickles and each job's <id>_<task>_log.out / .err
CLAIMS_DIR = "claims"  # <out>/jobs/claims/<checkpoint>.lock: held by the job scoring that checkpoint
STATUS_DIR = "status"  # <out>/jobs/status/<submission>.json: what a job says about itself (plain JSON)
STATES = ("running", "done", "failed")


def status_path(out_dir: str | Path, submission: str) -> Path:
    """`<out>/jobs/status/<submission>.json`: the job's own account of itself, in plain JSON (the driver never
    reads submitit's result pickle): {"submission", "job_id", "pid", "state": running | done | failed,
    "checkpoints": {name: "evaluated" | "reused"}, "error": one line}."""
    if not (isinstance(submission, str) and len(submission) == 32 and all(c in "0123456789abcdef" for c in submission)):
        raise ValueError(f"not a submission id: {submission!r}")
    return Path(out_dir) / JOBS_DIR / STATUS_DIR / f"{submission}.json"


def _write_status(job: EvalJob, submission: str | None, state: str, checkpoints: dict[str, str],
                  error: str | None = None) -> None:
    """Rank 0 of the job records its state (atomically; nothing in it is ever executed or unpickled)."""
    if submission is None or _rank() != 0:
        return
    from nano_eval.tracking.files import write_json

    try:
        import submitit

        job_id = str(submitit.JobEnvironment().job_id)
    except (ImportError, RuntimeError):
        job_id = ""
    write_json(status_path(job.output_dir, submission),
               {"submission": submission, "job_id": job_id, "pid": os.getpid(), "state": state,
                "checkpoints": checkpoints, "error": error}, root=job.output_dir)


class GroupFailed(RuntimeError):
    """Some checkpoints of a job's group failed (the message names each, with its error)."""


def _signalled_to_stop(error: BaseException) -> bool:
    """submitit's handler of Slurm's USR2 (sbatch --signal, sent `signal_delay_s` before --time runs out: launch.py)
    raises UncompletedJobError wherever the job is ("timed-out and not checkpointable"), possibly inside a library
    that wraps it (a checkpoint loader's own error, raised `from` it): the job's end, not the checkpoint's fault.
    (USR2 for a preemption makes submitit requeue the job and exit: SystemExit.)"""
    try:
        from submitit.core.utils import UncompletedJobError
    except ImportError:
        return False
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UncompletedJobError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def run_group(job: EvalJob, run_dir: str, items: list[WorkItem], dist_timeout_s: float,
              cwd: str | None = None, submission: str | None = None) -> dict[str, str]:
    """Evaluate `items` in order on every rank of this job; returns {checkpoint name: "evaluated" | "reused"}
    (rank 0's answer is the job's result). Raises GroupFailed after the last item when any of them failed.

    cwd: the driver's working directory, so relative paths (output dir, checkpoints, task files) mean there what
    they meant to the driver, and results.json records them as the sequential sweep does.
    submission: the driver's random id for this submission; rank 0 writes `status_path(out, submission)` when the
    job starts and when it ends (how the driver learns the outcome, and how a restarted driver proves the job is
    this sweep's before waiting for it)."""
    if cwd is not None:
        os.chdir(cwd)
    status: dict[str, str] = {}
    _write_status(job, submission, "running", status)
    try:
        _run_group(job, run_dir, items, dist_timeout_s, status)
    except BaseException as e:
        why = one_line(e, limit=1000)
        if _signalled_to_stop(e):
            why = ("stopped by Slurm's time-limit signal (USR2, sent shortly before the job's --time runs out); the "
                   "checkpoint in progress and those after it are left to the retry")
        try:
            _write_status(job, submission, "failed", status, why)
        except Exception:  # noqa: BLE001 -- the job's own error is the one to report
            pass
        raise
    _write_status(job, submission, "done", status)
    return status


def _run_group(job: EvalJob, run_dir: str, items: list[WorkItem], dist_timeout_s: float,
               status: dict[str, str]) -> None:
    from nano_eval.tasks import load_tasks

    _join_job_ranks(job.load.device, dist_timeout_s)
    main = _rank() == 0
    if main:
        print(f"nano_eval job: pid {os.getpid()}, checkpoints {', '.join(i.ckpt.shown for i in items)}", flush=True)
    tasks = load_tasks(job.tasks, custom_tasks=job.custom_tasks, data_dir=job.data_dir,
                       lm_eval_include_path=job.lm_eval_include_path)
    failed = []
    for item in items:
        name = item.ckpt.name
        with claim_checkpoint(Path(job.output_dir), name, hold=main):
            if _already_done(Path(job.output_dir) / name / "results.json", item.identity, root=job.output_dir):
                status[name] = "reused"
                continue
            start = time.perf_counter()
            try:
                evaluate_item(job, tasks, Path(run_dir), item)
                status[name] = "evaluated"
                if main:
                    print(f"nano_eval job: {item.ckpt.shown} (step {item.ckpt.step}): evaluated in "
                          f"{time.perf_counter() - start:.1f}s", flush=True)
            except BaseException as e:  # noqa: BLE001 -- recorded; the group's other checkpoints still run
                if _signalled_to_stop(e):
                    raise  # the job's end (its --time), not this checkpoint's fault: the group stops here
                if not isinstance(e, Exception) and not is_rust_panic(e):
                    raise  # Ctrl-C, SystemExit; a Rust library's panic (a checkpoint's tokenizer) is the checkpoint's
                failed.append(f"{name} (step {item.ckpt.step}): {one_line(e, limit=1000)}")
                if main:
                    import traceback

                    traceback.print_exception(e)
        free_memory()
    _leave_job_ranks()
    if failed:
        raise GroupFailed("; ".join(failed))


@contextmanager
def claim_checkpoint(out_dir: Path, name: str, hold: bool = True) -> Iterator[None]:
    """Hold `<out>/jobs/claims/<name>.lock` (an OS file lock: the kernel releases it when the job dies) while a job
    decides whether checkpoint `name` is done and scores it. Two jobs given the same checkpoint (a driver killed
    while submitting, then restarted, submits it again) take turns: the second waits, then finds the first one's
    results and reuses them, so no checkpoint is scored twice. Only the job's rank 0 holds it (hold=False: a no-op);
    the job's other ranks wait for rank 0's answer in `_already_done` meanwhile, within --dist-timeout."""
    if not hold:
        yield
        return
    from nano_eval.local_files import lock_file

    path = Path(out_dir) / JOBS_DIR / CLAIMS_DIR / f"{name}.lock"
    fd = lock_file(path, root=out_dir)  # no symlink below the output folder, none followed at the lock file
    if fd is None:
        print(f"nano_eval job: {printable(name)} is being scored by another job (lock {printable(str(path))}): "
              "waiting for it", flush=True)
        fd = lock_file(path, root=out_dir, blocking=True)
    try:
        yield
    finally:
        os.close(fd)


def _already_done(results_path: Path, identity: str, root: str | Path | None = None) -> bool:
    """Rank 0 looks at the file system and every rank of the job gets its answer (as runner.py's plan), so the
    ranks never disagree on whether a checkpoint is evaluated (one skipping while the others wait in a collective)."""
    import torch.distributed as dist

    box = [finished_identity(results_path, root=root) == identity if _rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return bool(box[0])


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _join_job_ranks(device: str, timeout_s: float) -> None:
    """One process group over the job's tasks when it has several (gloo on CPU, nccl on CUDA)."""
    import submitit
    import torch
    import torch.distributed as dist

    try:
        tasks = submitit.JobEnvironment().num_tasks
    except RuntimeError:  # called outside a submitit job (a plain call, e.g. from a debugger): one process
        return
    if tasks <= 1 or dist.is_initialized():
        return
    # keep every GPU visible: the rank picks its own by LOCAL_RANK, as under torchrun
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    if device.startswith("cuda"):
        torch.cuda.set_device(env.local_rank)
    print(f"nano_eval job: rank {env.rank} of {env.world_size} (master {env.master_addr}:{env.master_port})",
          file=sys.stderr, flush=True)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timedelta(seconds=timeout_s))


def _leave_job_ranks() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
