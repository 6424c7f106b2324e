"""What every command needs around its body: the torchrun process group, exit codes, and output streams that may
close (`| head`: the run goes on without them).

Exit codes: 0 done; 2 bad input (one `nano_eval: error: ...` line naming the thing and the fix); 1 anything else
(traceback, then one error line). Under torchrun a failing rank exits at once, so torchrun stops the others instead
of leaving them waiting in a collective.

A rank that stops answering (stopped, hung in a kernel, swapped out) makes the others' next collective fail after
`--dist-timeout` seconds; each of them then names the ranks that did not answer (they mark themselves in the process
group's store, and whoever is missing from it after a short grace period is reported) and the option.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from nano_eval.errors import EvaluationFailed, NanoEvalError
from nano_eval.local_files import single_line


def init_distributed(device: str, timeout_s: float) -> None:
    """Join the torchrun process group if launched by torchrun (gloo on CPU, nccl on GPU).

    The timeout bounds how long a rank waits in a collective for a peer that died (launchers other than torchrun
    do not kill the surviving ranks for us)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        global _DIST_TIMEOUT_S
        _DIST_TIMEOUT_S = timeout_s


_DIST_TIMEOUT_S: float | None = None  # the --dist-timeout of the process group init_distributed made


def looks_like_timeout(error: BaseException) -> bool:
    """A collective gave up waiting for a peer (gloo: "[...gloo/...] Timed out waiting 4000ms for recv", nccl's
    watchdog: a DistBackendError about a timeout). Other timeouts (an HTTP read) are not ours to explain."""
    text = str(error).lower()
    if not dist.is_initialized():
        return False
    if isinstance(error, (dist.DistBackendError, dist.DistStoreError)):
        return "time" in text
    return "gloo" in text and "timed out" in text


def unanswered_ranks(grace_s: float) -> list[int]:
    """Ranks that did not mark themselves in the default store within `grace_s` seconds, each rank that hit the
    timeout marking itself first. A rank that is stopped or stuck never marks itself; the store lives in the
    torchrun agent (or rank 0), so it answers while a worker is stuck."""
    store = dist.distributed_c10d._get_default_store()
    me, world = dist.get_rank(), dist.get_world_size()
    store.set(f"nano_eval/timed_out/{me}", "1")
    others = [r for r in range(world) if r != me]
    deadline = time.monotonic() + grace_s
    while True:
        missing = [r for r in others if not store.check([f"nano_eval/timed_out/{r}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.2)


def timeout_message(error: BaseException) -> str:
    """One line for a collective timeout: which ranks did not answer, and the option that sets the wait."""
    waited = f"{_DIST_TIMEOUT_S:g}s" if _DIST_TIMEOUT_S is not None else "the process group's timeout"
    try:
        missing = unanswered_ranks(grace_s=min(10.0, max(2.0, (_DIST_TIMEOUT_S or 10.0) / 2)))
    except Exception:  # noqa: BLE001 -- the store itself is gone: say what we know
        missing = None
    who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not answer"
           if missing else "a collective timed out")
    return (f"{who} within {waited} (--dist-timeout): stopped, hung or much slower than the others "
            f"({type(error).__name__}). Fix: look at what holds that rank (e.g. py-spy dump --pid PID), or raise "
            "--dist-timeout if it is only slow.")


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run_command(body: Callable[[], int | None], what: str) -> int:
    """Run a command's body on this rank and turn failures into exit codes every launcher understands (the body
    may return its own code; None is 0)."""
    rank = int(os.environ.get("RANK", "0"))
    prefix = f"[rank {rank}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    try:
        with quiet_broken_pipe():
            code = body() or 0
    except EvaluationFailed as e:  # every rank has it: rank 0 says it once (it names the failing ranks)
        if isinstance(e.__cause__, Exception) and not isinstance(e.__cause__, NanoEvalError):
            traceback.print_exception(e.__cause__)  # the failing rank's bug
        if rank == 0:
            print(f"nano_eval: error: {single_line(str(e))}", file=sys.stderr, flush=True)
        return e.exit_code
    except NanoEvalError as e:
        print(f"nano_eval: error: {prefix}{single_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if looks_like_timeout(e):
            print(f"nano_eval: error: {prefix}{what} failed: {timeout_message(e)}", file=sys.stderr, flush=True)
            return 1
        traceback.print_exc()
        print(f"nano_eval: error: {prefix}{what} failed: {type(e).__name__}: {single_line(str(e))}", file=sys.stderr)
        return 1
    if dist.is_initialized():
        # Leave together: a rank that tears its gloo group down while rank 0 still writes (a sweep's report)
        # was seen to abort ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
    return code


class _PipeSafe:
    """A text stream whose writes never raise OSError: once the reader is gone (`nano_eval ... 2>&1 | head -1`:
    BrokenPipeError) or the stream fails otherwise (EIO from a closed terminal), the file descriptor is pointed at
    /dev/null and the command goes on without that output (its files are still written). Progress bars (tqdm writes
    to sys.stderr) stop showing; nothing else changes."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())  # what is still buffered goes there too: no error at exit
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_broken_pipe() -> Iterator[None]:
    """Inside: sys.stdout and sys.stderr survive a closed pipe (see _PipeSafe), so neither the results table nor a
    progress bar can kill a run; streams without a file descriptor are left as they are (pytest's capture,
    io.StringIO)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_pipe_safe("stdout"))
        stack.enter_context(_pipe_safe("stderr"))
        yield


@contextlib.contextmanager
def _pipe_safe(name: str) -> Iterator[None]:
    """sys.<name> is a _PipeSafe inside (if it has a file descriptor); what it still buffers is flushed on exit."""
    stream = getattr(sys, name)
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    safe = _PipeSafe(stream)
    setattr(sys, name, safe)
    try:
        yield
    finally:
        safe.flush()  # what is still buffered meets a closed pipe here, not at interpreter exit
        if getattr(sys, name) is safe:
            setattr(sys, name, stream)
