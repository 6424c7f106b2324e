"""GPU-only checks (marked `gpu`: kept out of the default run, and skipped without CUDA).

Run on a GPU machine with `python -m pytest -m gpu tests/test_gpu.py`.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TASKS = "demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"


def _scores(checkpoint, device):
    from nano_eval.models.transformers_model import TransformersModel
    from tests.nanotron_worker import summarize

    return summarize(TransformersModel.from_pretrained(str(checkpoint), device=device), TASKS, 4096, 24)


def test_transformers_backend_on_cuda_matches_cpu(toy_checkpoint):
    cpu, cuda = _scores(toy_checkpoint, "cpu"), _scores(toy_checkpoint, "cuda")
    for key in cpu:
        assert cuda[key]["predictions"] == cpu[key]["predictions"]
        for a, b in zip(cpu[key]["logprobs"], cuda[key]["logprobs"], strict=True):
            assert b == pytest.approx(a, rel=1e-4, abs=1e-3)
