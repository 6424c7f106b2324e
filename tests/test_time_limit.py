"""nano_eval.time_limit: a backtracking regular expression is interrupted on the main thread, a host program's own
alarm is kept (re-armed with the time it had left, or left alone when it comes first), and nothing fires after a
block that ended in time."""

from __future__ import annotations

import re
import signal
import threading
import time

import pytest

from nano_eval.time_limit import TimeLimitExceeded, time_limit

BACKTRACKS = (r"((.|\n)+)+\x00", "a" * 40)  # exponential in the text's length: hours unless interrupted


def test_a_backtracking_regex_is_interrupted():
    start = time.monotonic()
    with pytest.raises(TimeLimitExceeded):
        with time_limit(0.3) as bounded:
            assert bounded
            re.findall(*BACKTRACKS)
    assert time.monotonic() - start < 5
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_a_block_that_ends_in_time_leaves_no_alarm_behind():
    previous = signal.getsignal(signal.SIGALRM)
    with time_limit(0.2) as bounded:
        assert bounded
    time.sleep(0.4)  # an alarm still armed would raise here
    assert signal.getsignal(signal.SIGALRM) is previous and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def test_the_hosts_alarm_is_kept():
    fired = []

    def host(signum, frame):
        fired.append(time.monotonic())

    previous = signal.signal(signal.SIGALRM, host)
    try:
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, 0.8)
        with time_limit(0.2) as bounded:  # ours first: it runs, then the host's timer goes on
            assert bounded
        assert 0.3 < signal.getitimer(signal.ITIMER_REAL)[0] <= 0.8
        time.sleep(1.0)
        assert len(fired) == 1 and 0.6 < fired[0] - start < 1.0, fired
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with time_limit(5) as bounded:  # the host's comes first: left as it is
            assert not bounded
            time.sleep(0.4)
        assert len(fired) == 2
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_another_thread_runs_unbounded():
    seen = []

    def run():
        with time_limit(0.1) as bounded:
            seen.append(bounded)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [False]
