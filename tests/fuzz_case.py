"""What the seeded fuzzes share (tests/checkpoint_fuzz.py, tests/surroundings_fuzz.py, tests/surroundings_fuzz2.py,
tests/surroundings_fuzz3.py): one case under a per-case alarm, counted as a timeout however the code under test
ended (it may wrap the alarm's exception in a refusal of its own), the process's address space, to cap memory above
it, the seeded loop over cases and its command line; and `within`, the alarm the hostile corpora's tests use."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable


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


def crash(e: BaseException) -> tuple[str, str]:
    """("memory" or "crash", the traceback's end) for an exception that escaped the code under test."""
    import traceback

    return ("memory" if isinstance(e, MemoryError) else "crash"), "".join(traceback.format_exception(e))[-1500:]


def run_cases(work: Path, seed: int, cases: int, make_world: Callable[[Path], Any], mutations: list,
              once: Callable[[Any], tuple[str, str]], alarm_s: int, cap_bytes: int) -> tuple[list[dict], float]:
    """The seeded loop: per case a fresh world (`make_world(folder)`), one mutation drawn with the seed (it returns
    what it did; printed to stderr first, so a case that kills the process is named), `once(world)` under the
    alarm, the folder removed. Memory is capped above the process's size for the loop. Returns the case records
    and the seconds the loop took."""
    _, uncap = cap_memory(cap_bytes)
    rng = random.Random(seed)
    out = []
    start = time.perf_counter()
    try:
        for i in range(cases):
            case = work / f"case_{i}"
            world = make_world(case)
            what = rng.choice(mutations)(world, rng)
            print(f"case {i}: {what}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            try:
                outcome, message = run_case(lambda: once(world), alarm_s)
            except BaseException as e:  # noqa: BLE001 - e.g. a snapshot of the victim folder itself failing
                outcome, message = crash(e)
            out.append({"mutation": what, "outcome": outcome, "message": message[:500],
                        "seconds": round(time.perf_counter() - t0, 3)})
            shutil.rmtree(case, ignore_errors=True)
    finally:
        uncap()
    return out, round(time.perf_counter() - start, 1)


def fuzz_main(run: Callable[[str, Path, int, int], dict], surfaces: list[str], argv=None) -> int:
    """`python -m tests.<fuzz> SURFACE WORK_DIR REPORT.json [--seed S] [--cases N]`: run(surface, work, seed, cases)
    and write its report as JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("surface", choices=surfaces)
    p.add_argument("work", type=Path)
    p.add_argument("report", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=50)
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    a.report.write_text(json.dumps(run(a.surface, a.work, a.seed, a.cases), indent=1))
    return 0


def within(seconds: int, fn, *args):
    """fn(*args), failed if it has not returned after `seconds` (an alarm interrupts a blocking open or read)."""
    def timeout(signum, frame):
        raise AssertionError(f"did not end within {seconds}s (blocked on a FIFO?)")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(seconds)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
