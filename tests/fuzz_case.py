"""What the seeded fuzzes share (tests/checkpoint_fuzz.py, tests/surroundings_fuzz.py, tests/surroundings_fuzz2.py):
one case under a per-case alarm, counted as a timeout however the code under test ended (it may wrap the alarm's
exception in a refusal of its own), and the process's address space, to cap memory above it."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path
from typing import Callable


class CaseTimeout(Exception):
    """Raised into the code under test when a case's alarm goes off."""


_fired = False


def _on_alarm(signum, frame):
    global _fired
    _fired = True
    raise CaseTimeout()


def install_alarm() -> None:
    """SIGALRM raises CaseTimeout (once per fuzz process, before the cases)."""
    signal.signal(signal.SIGALRM, _on_alarm)


def run_case(once: Callable[[], tuple[str, str]], seconds: int) -> tuple[str, str]:
    """once() -> (outcome, message), run under a `seconds` alarm; ("timeout", message) if the alarm went off."""
    global _fired
    _fired = False
    signal.alarm(seconds)
    try:
        try:
            outcome, message = once()
        except CaseTimeout:
            outcome, message = "timeout", ""
    finally:
        signal.alarm(0)
    return ("timeout", message) if _fired else (outcome, message)


def address_space() -> int:
    """This process's virtual size in bytes (RLIMIT_AS caps are set above it)."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[0])
    return pages * resource.getpagesize()


def cap_memory(extra_bytes: int) -> tuple[int, Callable[[], None]]:
    """Install the case alarm and limit the address space to this process's size now + `extra_bytes`; returns that
    size and the function that lifts the limit again."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = address_space()
    resource.setrlimit(resource.RLIMIT_AS, (size + extra_bytes, hard))
    install_alarm()
    return size, lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every entry under `folder` (links not followed): {relative path: bytes or a marker}."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(folder))
            seen[rel] = (b"<link>" + os.readlink(path).encode() if path.is_symlink() else
                         b"<dir>" if path.is_dir() else path.read_bytes())
    return seen
