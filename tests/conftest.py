"""Shared fixtures: a toy checkpoint built once per test session (seconds, no download); the process guard
(tests/process_guard.py): a test that leaves a process running fails, and so does a session that does; and the
megatron-core version matrix: with NANO_EVAL_REQUIRE_MEGATRON=<version> (CI's run in .venv-mc19, built by
scripts/setup_megatron_019.sh) the session refuses to start on any other megatron-core, and every skip (a missing
framework, a part that did not run) is a failure instead."""

import os
from pathlib import Path

import pytest

from tests.process_guard import (  # noqa: F401  (pytest hooks, found here by name)
    pytest_configure, pytest_runtest_setup, pytest_runtest_teardown, pytest_sessionfinish)

# Every process a test starts (torchrun ranks, run.py, sweeps) imports the nano_eval under test, never another copy
# that pip once installed in editable mode from a different checkout.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")) if p)

REQUIRED_MEGATRON = os.environ.get("NANO_EVAL_REQUIRE_MEGATRON")  # e.g. "0.19.2": that release, or fail


def pytest_sessionstart(session):
    if not REQUIRED_MEGATRON:
        return
    try:
        from nano_eval.compat.megatron import megatron_core_version
        installed = ".".join(map(str, megatron_core_version()))
    except ImportError:
        installed = "none"
    if installed != REQUIRED_MEGATRON:
        raise pytest.UsageError(f"NANO_EVAL_REQUIRE_MEGATRON={REQUIRED_MEGATRON} but megatron-core {installed} is "
                                "installed here. Fix: run in the venv of scripts/setup_megatron_019.sh "
                                "(.venv-mc19/bin/python -m pytest ...), as .ci/run does.")


def _required_not_skipped(report) -> None:
    """Under NANO_EVAL_REQUIRE_MEGATRON a skipped test or module is a failure (the version matrix must run)."""
    if REQUIRED_MEGATRON and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"NANO_EVAL_REQUIRE_MEGATRON={REQUIRED_MEGATRON} but this was skipped: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _required_not_skipped(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _required_not_skipped(outcome.get_result())


@pytest.fixture(scope="session")
def toy_checkpoint(tmp_path_factory):
    from nano_eval.toy import build_toy_checkpoint

    return build_toy_checkpoint(tmp_path_factory.mktemp("toy") / "ckpt", train_steps=20)


@pytest.fixture(scope="session")
def toy_backend(toy_checkpoint):
    from nano_eval.checkpoints.hf import load_transformers

    return load_transformers(str(toy_checkpoint))


@pytest.fixture(scope="session")
def lm_eval_include_dir(tmp_path_factory):
    """tests/lm_eval_layouts.py's lm-eval task YAMLs, one folder for the session (lm-eval indexes its catalogue once
    per process and include path)."""
    from tests.lm_eval_layouts import write_include_dir

    return write_include_dir(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="session")
def megatron_world(toy_checkpoint, tmp_path_factory):
    """One spawned world of 4 ranks running megatron-core's real GPTModel in the default layouts of
    tests/megatron_worker.py (all_layouts: scores, two torch_dist saves, a legacy one and the example's, a
    Megatron-style training run with the hook) and its MoE model (tests/megatron_moe_worker.py: moe_checks; an ep2
    torch_dist save in root / "moe_ep2"); shared by tests/test_megatron.py, tests/test_megatron_dist_ckpt.py and
    tests/test_megatron_moe.py so it is paid once."""
    return _megatron_world("all_layouts", toy_checkpoint, tmp_path_factory.mktemp("megatron_world"), wandb=True)


@pytest.fixture(scope="session")
def megatron_slow_world(toy_checkpoint, tmp_path_factory):
    """The slow set's world of 4 (tests/megatron_worker.py: slow_layouts): the other dense layouts, bf16 with
    Megatron-LM's fusions, every other MoE layout x dispatcher, `--backend megatron` at tp2 x ep2, MoE training."""
    return _megatron_world("slow_layouts", toy_checkpoint, tmp_path_factory.mktemp("megatron_slow_world"))


def _megatron_world(function: str, toy_checkpoint, root: Path, wandb: bool = False) -> dict:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    import tests.megatron_worker as worker
    from tests.dist_utils import run_distributed

    args = (str(toy_checkpoint), str(root)) + ((str(root / "wandb"),) if wandb else ())
    ranks = run_distributed(getattr(worker, function), 4, *args, timeout=1800, pg_timeout_s=120)
    return {"root": root, "ranks": ranks}


@pytest.fixture(scope="session")
def genuine_checkpoints(toy_checkpoint, tmp_path_factory):
    """{kind: path} of one genuine checkpoint of every kind nano_eval reads (tests/genuine_checkpoints.py), written
    by the frameworks' own save functions in a separate process (the CPU test doubles stay out of this one)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    pytest.importorskip("nanotron", reason="nanotron is not installed (pip install -e '.[nanotron]')")
    root = tmp_path_factory.mktemp("genuine")
    done = subprocess.run([sys.executable, "-W", "ignore", "-m", "tests.genuine_checkpoints", str(root),
                           str(toy_checkpoint)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return {kind: Path(path) for kind, path in json.loads(done.stdout.strip().splitlines()[-1]).items()}
