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
    """hooks/nanotron_eval.py with nanotron's real DistributedTrainer and real flash-attn on one GPU (bf16: flash-attn
    has no fp32), then the step-4 checkpoint scored by nanotron's own model (--backend nanotron) in mixed-length
    batches and one row per batch, and by the transformers conversion in fp32.

    Tolerances are set by what they must catch, not by bf16 noise alone: the model is initialised with std 0.15 so
    that it has opinions; a wrong rotary layout is measured here (the conversion without the q/k permutation) and
    the nanotron scores must sit at least 4x closer to the right conversion than that, and within 2e-2 relative;
    misaligned padded rows moved log-probs by ~10 nats on CPU, batch composition may move them by 5e-3 here."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.checkpoints.nanotron import load_nanotron_llama_as_hf, read_model_config
    from nano_eval.toy import build_tokenizer
    from nano_eval.tracking.jsonl import read_jsonl
    from tests.nanotron_worker import summarize, write_config

    repo = Path(__file__).resolve().parents[1]
    build_tokenizer().save_pretrained(tmp_path / "tokenizer")
    config = write_config(tmp_path / "train.yaml", str(tmp_path / "tokenizer"), tmp_path,
                          nano_eval={"tasks": TASKS, "interval": 2, "max_samples": 16, "output_dir": str(tmp_path / "eval"),
                                     "wandb": False}, train_steps=4, micro_batch_size=2, sequence_length=64)
    text = yaml_load(config)
    text["checkpoints"]["checkpoint_interval"] = 4
    text["model"]["dtype"] = "bfloat16"
    text["optimizer"]["accumulate_grad_in_fp32"] = True
    yaml_dump(text, config)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"]
    subprocess.run([*torchrun, str(repo / "hooks" / "nanotron_eval.py"), "--config-file", str(config)],
                   check=True, cwd=tmp_path)
    assert [r["step"] for r in read_jsonl(tmp_path / "eval" / "eval_results.jsonl")] == [2, 4]
    ckpt = tmp_path / "checkpoints" / "4"

    def run_py(name, *args):
        out = tmp_path / name
        subprocess.run([*torchrun, str(repo / "nano_eval" / "run.py"), "--checkpoint", str(ckpt), "--tasks", TASKS,
                        "--max-samples", "16", "--output-dir", str(out), "--no-details", *args], check=True, cwd=tmp_path)
        return json.loads((out / "results.json").read_text())["results"]

    mixed = run_py("nanotron_mixed", "--backend", "nanotron", "--dtype", "bfloat16", "--batch-tokens", "4096")
    alone = run_py("nanotron_alone", "--backend", "nanotron", "--dtype", "bfloat16", "--batch-tokens", "1")
    right = run_py("transformers", "--backend", "transformers", "--dtype", "float32")
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(tmp_path / "tokenizer"))
    wrong_model = load_nanotron_llama_as_hf(ckpt, {**read_model_config(ckpt), "rope_interleaved": False})
    wrong = summarize(TransformersModel(wrong_model.to("cuda"), tok), TASKS, 4096, 16)
    wrong = {task: wrong[task]["metrics"] for task in wrong}

    continuous = ("prob_norm_gold", "bits_per_byte_gold", "word_perplexity", "byte_perplexity", "bits_per_byte")

    def worst(a, b):  # accuracies may flip on near-ties in bf16; these move smoothly with the log-probs
        return max(abs(a[t][m] - b[t][m]) / abs(b[t][m]) for t in b for m in continuous if m in b[t])

    assert worst(mixed, alone) < 5e-3, "scores depend on batch composition"
    assert worst(mixed, right) < 2e-2
    assert worst(mixed, right) < 0.25 * worst(wrong, right), "no closer to the right rotary layout than to a wrong one"


def yaml_load(path):
    import yaml

    return yaml.safe_load(path.read_text())


def yaml_dump(data, path):
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False))
