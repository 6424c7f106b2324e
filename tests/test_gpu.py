"""GPU-only checks (marked `gpu`: kept out of the default run, and skipped without CUDA).

Run on a GPU machine with `python -m pytest -m gpu tests/test_gpu.py`.
"""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TASKS = "demo|arithmetic|0,demo|arithmetic_gen|3,demo|arithmetic_ppl|0"


def _scores(checkpoint, device):
    from nano_eval.checkpoints.hf import load_transformers
    from tests.nanotron_worker import summarize

    return summarize(load_transformers(str(checkpoint), device=device), TASKS, 4096, 24)


def test_transformers_backend_on_cuda_matches_cpu(toy_checkpoint):
    cpu, cuda = _scores(toy_checkpoint, "cpu"), _scores(toy_checkpoint, "cuda")
    for key in cpu:
        assert cuda[key]["predictions"] == cpu[key]["predictions"]
        for a, b in zip(cpu[key]["logprobs"], cuda[key]["logprobs"], strict=True):
            assert b == pytest.approx(a, rel=1e-4, abs=1e-3)


needs_nanotron_trainer = pytest.mark.skipif(
    not (importlib.util.find_spec("nanotron") and importlib.util.find_spec("flash_attn")),
    reason="needs nanotron and flash-attn (nanotron's own trainer and Llama)",
)


@needs_nanotron_trainer
def test_nanotron_launcher_trains_evaluates_and_its_checkpoint_scores_the_same(tmp_path):
    """hooks/nanotron_eval.py with nanotron's real DistributedTrainer on one GPU; then the saved checkpoint scored
    by nanotron's own model (--backend nanotron) and by the transformers conversion."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from nano_eval.toy import build_tokenizer
    from nano_eval.tracking.jsonl import read_jsonl

    repo = Path(__file__).resolve().parents[1]
    build_tokenizer().save_pretrained(tmp_path / "tokenizer")
    config = yaml.safe_load((repo / "examples" / "nanotron_eval.yaml").read_text())
    config["tokenizer"]["tokenizer_name_or_path"] = str(tmp_path / "tokenizer")
    config["checkpoints"].update(checkpoints_path=str(tmp_path / "ckpt"), checkpoint_interval=4)
    config["parallelism"].update(tp=1, dp=1, pp=1)
    config["model"]["dtype"] = "bfloat16"
    config["tokens"].update(train_steps=4, micro_batch_size=2, sequence_length=64)
    config["nano_eval"].update(tasks=TASKS, interval=2, also_at_steps=[], max_samples=16,
                               output_dir=str(tmp_path / "eval"), wandb=False)
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(config))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"]
    subprocess.run([*torchrun, str(repo / "hooks" / "nanotron_eval.py"), "--config-file", str(tmp_path / "train.yaml")],
                   check=True, cwd=tmp_path)
    assert [r["step"] for r in read_jsonl(tmp_path / "eval" / "eval_results.jsonl")] == [2, 4]

    results = {}
    for backend in ("nanotron", "transformers"):
        out = tmp_path / backend
        subprocess.run([*torchrun, str(repo / "nano_eval" / "run.py"), "--backend", backend, "--checkpoint",
                        str(tmp_path / "ckpt" / "4"), "--tasks", TASKS, "--max-samples", "16", "--dtype", "bfloat16",
                        "--output-dir", str(out)], check=True, cwd=tmp_path)
        results[backend] = json.loads((out / "results.json").read_text())["results"]
    for task, metrics in results["transformers"].items():
        for name, value in metrics.items():
            if not name.endswith("_stderr"):
                assert results["nanotron"][task][name] == pytest.approx(value, rel=0.05, abs=0.07), (task, name)
