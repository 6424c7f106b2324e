"""What the seeded fuzzes share (tests/checkpoint_fuzz.py, tests/surroundings_fuzz.py, tests/surroundings_fuzz2.py):
one case under a per-case alarm, counted as a timeout however the code under test ended (it may wrap the alarm's
exception in a refusal of its own), and the process's address space, to cap memory above it."""

from __future__ import annotations

import resource
import signal
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
