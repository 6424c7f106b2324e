"""Stop a sweep cleanly: SIGINT / SIGTERM set a flag that the loop reads between checkpoints.

The checkpoint in progress finishes and is written; a second SIGINT interrupts at once (KeyboardInterrupt).
"""

from __future__ import annotations

import signal
import sys
import threading
import time


class StopFlag:
    """Context manager that owns the SIGINT/SIGTERM handlers (main thread only; elsewhere it only holds a flag)."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None  # the first signal received
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = self.signum or signum
        print(f"nano_eval: {signal.Signals(signum).name} received: stopping after the checkpoint in progress "
              "(press Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    def sleep(self, seconds: float) -> None:
        """Sleep, waking early when a stop is requested."""
        end = time.monotonic() + seconds
        while not self.requested and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
