"""The test session leaves no process behind (a pytest plugin, loaded by tests/conftest.py; Linux, via /proc).

The pytest process makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER): a process whose parent dies, such
as a torchrun rank in a session of its own once torchrun is killed, is re-parented to pytest instead of init, so it
stays visible as a descendant of the session. Around each test (setup, call and teardown, so fixtures count too) the
descendants alive before and after are compared: one that is new and still alive after a short grace is SIGKILLed and
the test fails at teardown, naming it and the processes. At the end of the session wandb's service is shut down and
any descendant still alive is killed and fails the run.

Helpers the suite uses on purpose live for the whole session and are no leak while it runs: multiprocessing's
resource tracker (it ends when pytest exits and its pipe closes) and this process's own wandb service (`wandb-core
--pid <pytest's pid>`; shut down at the end of the session, then checked like any other process).
"""

import ctypes
import os
import signal
import sys
import time

import pytest

GRACE_S = 10.0  # how long a new process may take to finish exiting after its test (a stopped one gets none)
_BEFORE = pytest.StashKey[set]()
_started_in: dict[int, str] = {}  # pid of a session helper -> the test during which it appeared
_ENABLED = sys.platform == "linux"


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter: R running, S sleeping, T stopped, Z zombie, ...) of every process."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # the command name in (...) may hold spaces
            except OSError:  # ended meanwhile
                continue
            table[int(entry.name)] = (int(fields[1]), fields[0].decode())
    return table


def descendants(root: int) -> dict[int, str]:
    """pid -> state letter of every descendant of `root` (zombies included)."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child][1]
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Whether `pid` is still a process that holds memory (a zombie, dead and waiting to be reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def end_processes(pids, timeout: float = 30.0) -> None:
    """SIGKILL every pid (a stopped process too: SIGKILL needs no SIGCONT) and wait until none of them runs."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def end_process_tree(root: int) -> None:
    """SIGKILL `root` and all its descendants, recorded before the kill (those in sessions or process groups of their
    own too, which a killpg of root's group misses), and wait until none of them runs."""
    end_processes([root, *descendants(root)])


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _is_wandb_service(pid: int) -> bool:
    """wandb's service for this very process (wandb.init starts it; wandb.teardown or our exit ends it)."""
    argv = _cmdline(pid)
    return bool(argv) and os.path.basename(argv[0]) == "wandb-core" and \
        any(a == "--pid" and b == str(os.getpid()) for a, b in zip(argv, argv[1:]))


def _resource_tracker_pid() -> int | None:
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    return getattr(tracker, "_pid", None)


def _reap(pids) -> None:
    """Collect the exit status of those of `pids` that are zombie children of pytest (orphans it adopted, say)."""
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child, or already collected
            pass


def _left_behind(before: set[int], spare_helpers: bool) -> dict[int, str]:
    """pid -> state of the descendants of pytest not in `before` that still run after up to GRACE_S seconds."""
    deadline = time.monotonic() + GRACE_S
    while True:
        now = descendants(os.getpid())
        new = {pid: state for pid, state in now.items() if pid not in before}
        _reap([pid for pid, state in new.items() if state == "Z"])
        live = {pid: state for pid, state in new.items() if state not in "ZX"}
        if spare_helpers:
            live = {pid: state for pid, state in live.items()
                    if pid != _resource_tracker_pid() and not _is_wandb_service(pid)}
        if time.monotonic() > deadline or all(state in "Tt" for state in live.values()):  # none will exit
            return live
        time.sleep(0.1)


def _describe(processes: dict[int, str]) -> str:
    return "; ".join(f"pid {pid} ({'stopped' if state in 'Tt' else 'running'}): "
                     f"{' '.join(_cmdline(pid))[:160] or '?'}" for pid, state in sorted(processes.items()))


def pytest_configure(config):
    if _ENABLED:
        PR_SET_CHILD_SUBREAPER = 36
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if _ENABLED:
        item.stash[_BEFORE] = set(descendants(os.getpid()))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        if _BEFORE in item.stash:
            before = item.stash[_BEFORE]
            left = _left_behind(before, spare_helpers=True)
            for pid in set(descendants(os.getpid())) - before - set(left):  # a session helper it started
                _started_in.setdefault(pid, item.nodeid)
            if left:
                description = _describe(left)
                end_processes(list(left))
                _reap(left)
                pytest.fail(f"{item.nodeid} left {len(left)} process(es) behind (now killed): {description}",
                            pytrace=False)


def pytest_sessionfinish(session):
    if not _ENABLED:
        return
    if "wandb" in sys.modules and hasattr(sys.modules["wandb"], "teardown"):
        sys.modules["wandb"].teardown()  # ends this process's wandb-core, as at exit
    tracker = _resource_tracker_pid()
    left = _left_behind({tracker} if tracker else set(), spare_helpers=False)
    if left:
        lines = [f"{_describe({pid: state})} (started during {_started_in.get(pid, 'the session')})"
                 for pid, state in sorted(left.items())]
        end_processes(list(left))
        _reap(left)
        writer = session.config.get_terminal_writer()
        writer.sep("=", "processes left behind by the test session (now killed)", red=True)
        for line in lines:
            writer.line(line, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
