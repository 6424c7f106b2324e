"""Shared fixtures: a toy checkpoint built once per test session (seconds, no download)."""

import pytest


@pytest.fixture(scope="session")
def toy_checkpoint(tmp_path_factory):
    from nano_eval.toy import build_toy_checkpoint

    return build_toy_checkpoint(tmp_path_factory.mktemp("toy") / "ckpt", train_steps=20)


@pytest.fixture(scope="session")
def toy_backend(toy_checkpoint):
    from nano_eval.checkpoints.hf import load_transformers

    return load_transformers(str(toy_checkpoint))
