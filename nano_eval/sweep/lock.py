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
        self.out = Path(out_dir)
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        from nano_eval.local_files import STATE_BYTES, LocalFileError, lock_file, printable, read_text, real_dir

        real_dir(self.out, create=True)
        self._fd = lock_file(self.out / LOCK_NAME)  # a symlink or FIFO planted there is refused, never followed
        if self._fd is None:
            try:
                owner = " ".join(read_text(self.out / OWNER_NAME, STATE_BYTES, root=self.out).split())[:300]
            except (OSError, LocalFileError):
                owner = "unknown"
            raise OutputBusy(f"output folder {printable(str(self.out))} is in use by another sweep "
                             f"({printable(owner)}; lock file {printable(str(self.out / LOCK_NAME))}). Fix: pass "
                             "--wait to start once that sweep ends, or pass another --output-dir.", owner) from None
        started = datetime.now(timezone.utc).isoformat(timespec="seconds")
        try:
            atomic_write_text(self.out / OWNER_NAME, f"pid {os.getpid()} on {socket.gethostname()}, started "
                              f"{started}\n", root=self.out)
        except BaseException:
            self._release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        from nano_eval.local_files import LocalFileError, remove_file

        try:
            remove_file(self.out / OWNER_NAME, root=self.out)
        except LocalFileError:
            pass  # something else took its place: left alone
        finally:
            self._release()

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None


def check_settings(out_dir: str | Path, settings: dict) -> None:
    """Refuse an output folder whose earlier sweep used other settings; record them in a new one. A
    sweep_settings.json that cannot be read (not JSON, not an object of settings, a FIFO, a symlink, too large) is
    refused with its name and the fix: it guards the folder's results, so it is never guessed at or replaced."""
    from nano_eval.local_files import LocalFileError, printable, read_json

    path = Path(out_dir) / SETTINGS_NAME
    settings = json.loads(json.dumps(settings))  # compared as JSON reads it back (tuples are lists)
    try:
        theirs = read_json(path, root=out_dir)
    except FileNotFoundError:
        write_json(path, settings, root=out_dir)
        return
    except LocalFileError as e:
        raise NanoEvalError(f"cannot use {printable(str(path))}: it {printable(e.what)}. Fix: delete it if the "
                            "folder holds no results you need (the next sweep writes it anew), or pass another "
                            "--output-dir.") from None
    diffs = settings_differences(settings, theirs)
    if diffs:
        raise NanoEvalError(f"output folder {printable(str(path.parent))} holds a sweep evaluated with other "
                            f"settings: {printable('; '.join(diffs))[:2000]}. Fix: pass another --output-dir, or the "
                            f"same settings as before (or delete {printable(str(path))} and the results next to it "
                            "to start over).")
