"""A wall-clock limit for code that keeps no clock of its own: regular expressions and Jinja filters from a task file.

A task YAML can carry a regular expression that backtracks for hours on one model output (`(a+)+$`), in a
`regex` filter of its `filter_list` or a template's `regex_replace`. One `re` call is one C call, so no step counter
sees it; but CPython's regex engine checks for signals while it backtracks, so a SIGALRM handler that raises ends
it. `time_limit` arms the process's real-time timer (ITIMER_REAL) for a block and puts everything back after it.

Signals reach only the main thread, so the limit holds there (the training hook, run.py, a sweep job); in another
thread the block runs unbounded and `time_limit` yields False. A timer the host program (or an outer block) already
armed is kept: when it would fire first it stays as it is (yields False); else ours runs, and after the block the
host's handler is back and its timer re-armed with the time it had left.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator


class TimeLimitExceeded(Exception):
    """Raised inside a `time_limit` block once its seconds have passed."""


@contextmanager
def time_limit(seconds: float) -> Iterator[bool]:
    """Raise TimeLimitExceeded in the block after `seconds` of wall time; yields whether the block is bounded."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    if outer_left and outer_left <= seconds:  # the host's alarm comes first: leave it be
        yield False
        return
    armed = [True]

    def expired(signum, frame):
        if armed[0]:  # not once the block has ended (a signal already on its way)
            raise TimeLimitExceeded(f"{seconds:g}s")

    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield True
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)  # None: set from C
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - start), 1e-3), outer_interval)
