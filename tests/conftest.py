"""Shared fixtures: a toy checkpoint built once per test session (seconds, no download); and the process guard
(tests/process_guard.py): a test that leaves a process running fails, and so does a session that does."""

import pytest

from tests.process_guard import (  # noqa: F401  (pytest hooks, found here by name)
    pytest_configure, pytest_runtest_setup, pytest_runtest_teardown, pytest_sessionfinish)


@pytest.fixture(scope="session")
def toy_checkpoint(tmp_path_factory):
    from nano_eval.toy import build_toy_checkpoint

    return build_toy_checkpoint(tmp_path_factory.mktemp("toy") / "ckpt", train_steps=20)


@pytest.fixture(scope="session")
def toy_backend(toy_checkpoint):
    from nano_eval.checkpoints.hf import load_transformers

    return load_transformers(str(toy_checkpoint))


@pytest.fixture(scope="session")
def megatron_world(toy_checkpoint, tmp_path_factory):
    """One spawned world of 4 ranks running megatron-core's real GPTModel in every layout of
    tests/megatron_worker.py (scores, two torch_dist saves, a legacy one and the example's, a Megatron-style
    training run with the hook); shared by tests/test_megatron.py and tests/test_megatron_dist_ckpt.py so it is
    paid once."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'nano_eval[megatron]')")
    from tests.dist_utils import run_distributed
    from tests.megatron_worker import all_layouts

    root = tmp_path_factory.mktemp("megatron_world")
    ranks = run_distributed(all_layouts, 4, str(toy_checkpoint), str(root), str(root / "wandb"), timeout=900)
    return {"root": root, "ranks": ranks}
