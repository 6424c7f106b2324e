"""The process guard (tests/process_guard.py) run for real: a pytest of a small test file, in a subprocess with only
the guard as a plugin. A stopped process orphaned in a session of its own (what torchrun's ranks become once torchrun
is killed) fails the test that left it, and is killed; one started outside any test fails the session; wandb's
service and multiprocessing's resource tracker, which live for the whole session on purpose, fail nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

LEAKS = '''
import os, signal, subprocess, sys

# Started while the module is collected, outside any test: only the end of the session can see it.
os.kill(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid, signal.SIGSTOP)

SPAWN = "import subprocess, sys, time; print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], " \\
        "start_new_session=True).pid, flush=True); time.sleep(600)"


def test_leaks_a_stopped_orphan(tmp_path_factory):
    parent = subprocess.Popen([sys.executable, "-c", SPAWN], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    os.kill(child, signal.SIGSTOP)
    os.killpg(parent.pid, signal.SIGKILL)  # as the old hung-rank test did: the child is in another session
    parent.wait()
    (tmp_path_factory.getbasetemp().parent / "leaked_pid").write_text(str(child))


def test_clean():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''

HELPERS = '''
import multiprocessing
import os


def test_wandb_service_and_resource_tracker(tmp_path):
    import wandb

    run = wandb.init(project="guard", dir=str(tmp_path), mode="offline")
    run.log({"x": 1})
    run.finish()
    worker = multiprocessing.get_context("spawn").Process(target=os.getpid)  # starts the resource tracker
    worker.start()
    worker.join()


def test_after_them():
    pass
'''


def _pytest(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's settings or conftest
    (tmp_path / "test_inner.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.process_guard", "-p", "no:cacheprovider",
                           f"--basetemp={tmp_path / 'inner'}", "test_inner.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


@pytest.mark.skipif(sys.platform != "linux", reason="the guard reads /proc")
def test_a_leaked_stopped_process_fails_its_test_and_the_session(tmp_path):
    done = _pytest(tmp_path, LEAKS)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    assert "2 passed, 1 error" in out, out  # the leaking test at its teardown; test_clean is not blamed
    assert "ERROR at teardown of test_leaks_a_stopped_orphan" in out, out
    leaked = int((tmp_path / "leaked_pid").read_text())
    assert f"test_inner.py::test_leaks_a_stopped_orphan left 1 process(es) behind (now killed): pid {leaked} " \
           "(stopped)" in out, out
    assert _gone(leaked)
    assert "processes left behind by the test session (now killed)" in out, out
    assert "(stopped): " in out.split("processes left behind by the test session")[1] and \
           "(started during the session)" in out, out


@pytest.mark.skipif(sys.platform != "linux", reason="the guard reads /proc")
def test_helpers_that_live_for_the_session_are_no_leak(tmp_path):
    pytest.importorskip("wandb")
    done = _pytest(tmp_path, HELPERS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout and "left" not in done.stdout, done.stdout
