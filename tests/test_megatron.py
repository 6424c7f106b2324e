"""The Megatron-Core backend on CPU/gloo: TP2 / DP2 equal one process, log-probs agree with Megatron's own
vocab_parallel_cross_entropy, a TP2 legacy checkpoint converts to transformers with the same scores, and the
pretrain hook scores the live model.

The model is built from megatron-core's real VocabParallelEmbedding / Column- / RowParallelLinear on real gloo
process groups (tests/toy_megatron.py); GPTModel itself needs CUDA (tests/test_megatron_gpu.py).
"""

import json

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'nano_eval[megatron]')")

import torch  # noqa: E402

from nano_eval.errors import NanoEvalError  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.megatron_worker import TASKS, evaluate_layout, tp2_checks  # noqa: E402

EXACT = ("acc", "acc_norm", "acc_norm_token", "acc_norm_pmi", "exact_match", "quasi_exact_match")
ITERATION = 100


def _single(per_rank):
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the results"
    return per_rank[0]


def assert_same_scores(ref: dict, got: dict, what: str):
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
def runs(toy_checkpoint, tmp_path_factory):
    """Three spawned worlds: TP1 (the reference), TP2 (scores, cross-entropy, checkpoint save, hook), DP2."""
    tok, root = str(toy_checkpoint), tmp_path_factory.mktemp("megatron")
    out = {"reference": _single(run_distributed(evaluate_layout, 1, 1, tok))}
    out["tp2"] = _single(run_distributed(tp2_checks, 2, tok, str(root / "run"), str(root / "hook")))
    out["dp2"] = _single(run_distributed(evaluate_layout, 2, 1, tok, 96))
    out["root"] = root
    return out


@pytest.mark.parametrize("layout, expected", [("tp2", {"tp": 2, "dp": 1}), ("dp2", {"tp": 1, "dp": 2})])
def test_layout_matches_single_process(runs, layout, expected):
    scores = runs[layout]["scores"] if layout == "tp2" else runs[layout]
    if layout == "tp2":
        assert {k: runs["tp2"]["layout"][k] for k in expected} == expected
    assert_same_scores(runs["reference"], scores, layout)


@pytest.mark.slow
def test_tp2_x_dp2_matches_single_process(runs, toy_checkpoint):
    assert_same_scores(runs["reference"], _single(run_distributed(evaluate_layout, 4, 2, str(toy_checkpoint), 96)),
                       "tp2xdp2")


def test_logprobs_match_megatrons_vocab_parallel_cross_entropy(runs):
    """Engine log-probs (MegatronModel + nano_eval's vocab-parallel scoring) = -sum of Megatron's own loss."""
    assert runs["tp2"]["cross_entropy"] < 1e-5


def test_legacy_checkpoint_layout(runs):
    run_dir = runs["root"] / "run"
    assert (run_dir / "latest_checkpointed_iteration.txt").read_text() == str(ITERATION)
    shards = sorted(p.name for p in (run_dir / f"iter_{ITERATION:07d}").iterdir())
    assert shards == ["mp_rank_00", "mp_rank_01"]


def test_converter_reproduces_the_logical_weights(runs):
    """Merging TP shards, un-grouping linear_qkv and un-fusing linear_fc1 per shard give the exact tensors the toy
    model was built from (a wrong split of either fused matrix fails here)."""
    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf
    from tests.toy_megatron import ToyConfig, logical_weights

    hf = load_megatron_llama_as_hf(runs["root"] / "run" / f"iter_{ITERATION:07d}")
    state = hf.state_dict()
    for name, expected in logical_weights(ToyConfig()).items():
        assert torch.equal(state[name], expected), name
    assert hf.config.num_key_value_heads == 2 and not hf.config.tie_word_embeddings


def test_converted_checkpoint_scores_like_the_megatron_model(runs, toy_checkpoint):
    """Run dir -> tracker -> iter folder -> LlamaForCausalLM -> same scores as the TP2 Megatron model."""
    from nano_eval.checkpoints.megatron_legacy import is_megatron_checkpoint, load_as_transformers
    from tests.nanotron_worker import summarize

    run_dir = runs["root"] / "run"
    assert is_megatron_checkpoint(str(run_dir)) and is_megatron_checkpoint(str(run_dir / f"iter_{ITERATION:07d}"))
    backend = load_as_transformers(str(run_dir), str(toy_checkpoint))
    assert_same_scores(runs["tp2"]["scores"], summarize(backend, TASKS, 4096, 12), "transformers")


def test_pretrain_hook_scores_the_live_model(runs):
    """non_loss_data_func([chunks]) at two iterations: scores equal the direct TP2 evaluation, consumed tokens come
    from the iteration, the model's train flags are restored, and rank 0 wrote one JSONL line per evaluation."""
    hook = runs["tp2"]["hook"]
    assert hook["steps"] == [300, 400] and hook["tokens"] == [300 * 1024, 400 * 1024]
    direct = {k: v for k, v in runs["tp2"]["scores"]["demo|arithmetic|0"]["metrics"].items()}
    for metrics in hook["metrics"]:
        assert {k: v for k, v in metrics.items() if not k.endswith("_stderr")} == pytest.approx(direct, rel=1e-9)
    assert hook["training_restored"]
    lines = (runs["root"] / "hook" / "eval_results.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [300, 400]


def test_checkpoint_errors_say_what_to_do(runs, tmp_path):
    from nano_eval.checkpoints.megatron_args import load_shard
    from nano_eval.checkpoints.megatron_legacy import is_megatron_checkpoint, load_megatron_llama_as_hf

    dist_ckpt = tmp_path / "iter_0000005"
    dist_ckpt.mkdir()
    (dist_ckpt / ".metadata").write_bytes(b"")
    (dist_ckpt / "__0_0.distcp").write_bytes(b"")
    assert is_megatron_checkpoint(str(dist_ckpt)) and not is_megatron_checkpoint(str(tmp_path))
    with pytest.raises(NanoEvalError, match="no common.pt"):  # torch_dist: tests/test_megatron_dist_ckpt.py
        load_megatron_llama_as_hf(dist_ckpt)

    partial = tmp_path / "iter_0000006"
    (partial / "mp_rank_01").mkdir(parents=True)
    with pytest.raises(NanoEvalError, match=r"missing shards \['mp_rank_00', 'mp_rank_01'\]"):
        load_megatron_llama_as_hf(partial)

    unsafe = tmp_path / "unsafe.pt"
    torch.save({"model": {}, "args": NanoEvalError("a class outside the allow-list")}, unsafe)
    with pytest.raises(NanoEvalError, match="weights_only=True"):
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
