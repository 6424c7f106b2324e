"""One sweep per output folder, and one evaluation identity per output folder.

`OutputLock` holds `<out>/.nano_eval_sweep.lock` (an OS file lock via `filelock`: released by the kernel when the
process dies, even by SIGKILL, so a crashed sweep never blocks the next one) for the whole sweep; a second sweep
into the same folder stops at once with a message naming the holder (`<out>/.nano_eval_sweep.owner`: pid, host,
start time), raising `OutputBusy` (the sweep's `--wait` catches it and tries again until the holder is done).
`check_settings` keeps `<out>/sweep_settings.json`, the settings part of the evaluation identity (tasks, task
versions, max_samples, seed, ...): a sweep with other settings into the same folder is refused with the differences
named, instead of silently overwriting the results of the first.
"""

from __future__ import annotations

import json
import os
import socket
from datetime import datetime, timezone
from pathlib import Path

from nano_eval.errors import NanoEvalError
from nano_eval.sweep.identity import settings_differences
from nano_eval.tracking.files import atomic_write_text, write_json

LOCK_NAME, OWNER_NAME, SETTINGS_NAME = ".nano_eval_sweep.lock", ".nano_eval_sweep.owner", "sweep_settings.json"


class OutputBusy(NanoEvalError):
    """Another live sweep holds the output folder; `owner` says who (pid, host, start time)."""

    def __init__(self, message: str, owner: str):
        super().__init__(message)
        self.owner = owner


class OutputLock:
    """Context manager: the output folder belongs to this process until exit (or until the process dies)."""

    def __init__(self, out_dir: str | Path):
        from filelock import FileLock

        self.out = Path(out_dir)
        self._lock = FileLock(str(self.out / LOCK_NAME))

    def __enter__(self) -> OutputLock:
        from filelock import Timeout

        self.out.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            try:
                owner = (self.out / OWNER_NAME).read_text().strip()
            except OSError:
                owner = "unknown"
            raise OutputBusy(f"output folder {self.out} is in use by another sweep ({owner}; lock file "
                             f"{self.out / LOCK_NAME}). Fix: pass --wait to start once that sweep ends, or pass "
                             "another --output-dir.", owner) from None
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        atomic_write_text(self.out / OWNER_NAME, f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        return self

    def __exit__(self, *exc) -> None:
        (self.out / OWNER_NAME).unlink(missing_ok=True)
        self._lock.release()


def check_settings(out_dir: str | Path, settings: dict) -> None:
    """Refuse an output folder whose earlier sweep used other settings; record them in a new one."""
    path = Path(out_dir) / SETTINGS_NAME
    settings = json.loads(json.dumps(settings))  # compared as JSON reads it back (tuples are lists)
    try:
        theirs = json.loads(path.read_text())
    except FileNotFoundError:
        write_json(path, settings)
        return
    except (OSError, ValueError) as e:
        raise NanoEvalError(f"cannot read {path} ({e}). Fix: delete it if the folder holds no results you need, "
                            "or pass another --output-dir.") from e
    diffs = settings_differences(settings, theirs)
    if diffs:
        raise NanoEvalError(f"output folder {path.parent} holds a sweep evaluated with other settings: "
                            f"{'; '.join(diffs)}. Fix: pass another --output-dir, or the same settings as before "
                            f"(or delete {path} and the results next to it to start over).")
