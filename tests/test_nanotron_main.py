"""nano_eval on nanotron MAIN (the SmolLM3 code, huggingface/nanotron 2411b022): its REAL Qwen2ForTraining and
DistributedTrainer on CPU/gloo (tests/nanotron_main_cpu.py), tiny Qwen2s: dense, no-RoPE layers, qkv bias, sliding
window, MoE.

- the live backend speaks Qwen2's contract: its logits at the scored positions of a right-padded batch equal the
  model's own forward on each row alone (tp2, tp1 x dp2; slow: tp2 REDUCE_SCATTER), for every variant; the dense
  model's scores equal the transformers conversion of the same checkpoint (next item);
- context parallelism (cp2, llama3 ring attention) is folded into data parallelism while scoring: scores equal
  cp1's, the ring is back on (bitwise the same training-mode forward and backward) after;
- pp2 on nanotron main as released (its own pp bugs) is refused on BOTH ranks before any forward (it used to
  leave stage 1 in a P2P receive for ever); with the upstream fixes (test-only) pp2 logits are exact;
- the training hook (hooks/nanotron_eval.py, nano_eval's trainer mixin) in main's trainer: losses bitwise equal
  with and without evaluation (dense tp2, no-RoPE dp2; slow: MoE, qkv bias, sliding window, pp2), evaluations at
  steps 2, 3, 4 with main's consumed tokens, live step-3 scores = the step-3 checkpoint's (transformers conversion
  for dense, --backend nanotron for no-RoPE);
- greedy generation decodes from nano_eval's Qwen2 KV cache (nano_eval.backends.nanotron_qwen2_cache; nanotron
  main's Qwen2 has none): its logits equal the scoring forward's, its generations the re-run path's token for token,
  for every variant at tp2, at tp1 x dp2, pp2 (upstream pp fixed) and cp2 folded into dp; refused under
  REDUCE_SCATTER;
- `run.py --checkpoint` converts dense Qwen2 to transformers' Llama and no-RoPE / qkv-bias / sliding-window Qwen2
  to transformers' SmolLM3, with the live backend's scores; it refuses MoE by field (no transformers class matches).

nanotron main is not the global environment's nanotron (0.4): these tests run in the venv `.ci/run` builds
(scripts/setup_nanotron_main.sh) and skip elsewhere, or FAIL when NANO_EVAL_REQUIRE_NANOTRON_MAIN=1 (CI).
"""

import os

import pytest

from nano_eval.errors import NanoEvalError
from tests.nanotron_main_cpu import is_main

REQUIRED = os.environ.get("NANO_EVAL_REQUIRE_NANOTRON_MAIN") == "1"
TOLERANCE = 2e-5  # |logit| <= ~5; padded batch vs one row alone differ by float rounding only
BF16_TOLERANCE = 0.0625  # two bf16 steps at |logit| in [4, 8)


def require_main():
    if is_main():
        return
    reason = ("nanotron main is not installed here (the global environment has nanotron 0.4). Run these tests in "
              "the venv of scripts/setup_nanotron_main.sh (.ci/run does)")
    if REQUIRED:
        pytest.fail(f"NANO_EVAL_REQUIRE_NANOTRON_MAIN=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def world(request, tmp_path_factory):
    """tests/nanotron_main_worker.main_world in one spawned world of 2 ranks."""
    require_main()  # before the toy tokenizer is built
    toy_checkpoint = request.getfixturevalue("toy_checkpoint")
    from tests.dist_utils import run_distributed
    from tests.nanotron_main_worker import main_world

    os.environ.setdefault("WANDB_MODE", "disabled")
    root = tmp_path_factory.mktemp("nanotron_main")
    slow = os.environ.get("NANO_EVAL_NANOTRON_MAIN_SLOW") == "1"
    ranks = run_distributed(main_world, 2, str(root), str(toy_checkpoint), slow, timeout=900)
    return root, ranks


def _last_stage_values(ranks, part, key):
    return [r[part][key] for r in ranks if key in r[part]]


def test_backend_logits_equal_the_models_own_forward(world):
    _, ranks = world
    print("world phases (s since start):", {k: round(v, 1) for k, v in ranks[0]["times"].items()})
    keys = {k for r in ranks for k in r["backend"] if len(k) == 2}
    assert {("dense", "tp2"), ("dense", "tp1xdp2"), ("nope", "tp2"), ("moe", "tp2"), ("bias", "tp2"),
            ("swa", "tp2"), ("nope_swa", "tp2")} <= keys
    for key in sorted(keys):
        values = _last_stage_values(ranks, "backend", key)
        assert values and all(isinstance(v, float) and v < TOLERANCE for v in values), (key, values)
        print(f"{key}: max |logit diff| {max(values):.1e}")


@pytest.mark.parametrize("variant", ["dense", "nope", "bias", "swa", "nope_swa"])
def test_live_scores_equal_the_transformers_conversion(world, variant):
    """run.py --checkpoint's conversion: dense Qwen2 -> transformers Llama; no-RoPE layers, qkv bias, sliding window
    -> transformers SmolLM3 (before: read as a Llama without notice, logits off by up to 5.5). nope_swa: the no-RoPE
    layers without a window (nanotron drops it there), the others with one."""
    from transformers import AutoTokenizer

    from nano_eval.backends.transformers import TransformersModel
    from nano_eval.checkpoints.nanotron import load_nanotron_llama_as_hf, tokenizer_path
    from tests.nanotron_main_worker import TASKS
    from tests.nanotron_worker import summarize

    _, ranks = world
    ckpt = ranks[0]["ckpts"][variant]
    model = load_nanotron_llama_as_hf(ckpt)
    assert type(model).__name__ == ("LlamaForCausalLM" if variant == "dense" else "SmolLM3ForCausalLM")
    reference = summarize(TransformersModel(model, AutoTokenizer.from_pretrained(tokenizer_path(ckpt, None)),
                                            max_length=64), TASKS, 256, 6)
    live = ranks[0]["backend"][(variant, "tp2", "scores")]
    _same_scores(live, reference)


def _same_scores(got, want, rel=1e-5):
    assert got.keys() == want.keys()
    for task in want:
        for name, value in want[task]["metrics"].items():
            assert got[task]["metrics"][name] == pytest.approx(value, rel=rel, abs=1e-9), (task, name)
        for a, b in zip(got[task]["logprobs"], want[task]["logprobs"]):
            assert a == pytest.approx(b, rel=rel, abs=1e-5), task
        assert got[task]["predictions"] == want[task]["predictions"], task


def test_qwen2_cache_logits_equal_the_scoring_forward(world):
    """nano_eval's Qwen2 KV cache (nano_eval.backends.nanotron_qwen2_cache) driven through the KVCache protocol:
    left-padded prompts of 3, 9, 6 and 1 tokens, one-token steps, rows dropped / repeated / reordered, a
    3-column extend with padding in the middle, a new prompt written into a row from a cache of its own and the
    leading padding columns dropped: the logits at every last column equal the backend's scoring
    forward on the same tokens, for every variant at tp2 (no-RoPE layers, qkv bias, sliding window, both, MoE),
    at tp1 x dp2 and at pp2 (nanotron's own pp fixed; the cache moves states with the model's P2P); in bf16 (dense,
    MoE at tp2) within two bf16 steps."""
    _, ranks = world
    keys = {k for r in ranks for k in r["cache"]}
    assert {(v, "tp2") for v in ("dense", "nope", "bias", "swa", "nope_swa", "moe")} | {
        ("dense", "tp1xdp2"), ("bias", "tp1xdp2"), ("dense", "pp2"), ("nope", "pp2"), ("dense", "tp2-bf16"),
        ("moe", "tp2-bf16")} <= keys
    for key in sorted(keys):
        results = [r["cache"][key] for r in ranks]
        assert all(res["reason"] is None for res in results), (key, results)
        compared = [res for res in results if "max_diff" in res]  # lm_head's stage (both ranks unless pp2)
        assert compared and len(compared) == (1 if key[1] == "pp2" else 2), (key, results)
        tolerance = BF16_TOLERANCE if key[1].endswith("bf16") else TOLERANCE
        assert all(res["calls"] == 8 and res["max_diff"] < tolerance for res in compared), (key, compared)
        print(f"cache {key}: max |logit diff| {max(res['max_diff'] for res in compared):.1e}")


def test_qwen2_cached_generation_equals_the_rerun_path(world):
    """Greedy generations through the Qwen2 KV cache equal the re-run path's token for token (fp32), with rows of
    different prompt lengths and (with a stop sequence) rows finishing at different steps, and on prompts with a
    common prefix the decoder prefills once (padding in the middle of the rows; 2 rows for 3 prompts: the third
    refills a freed slot from the pool's prefix cache); the cache puts each prompt through
    the embedding once, the re-run path prompt x answer tokens. tp2 (dense, no-RoPE, qkv bias,
    sliding window, MoE), tp1 x dp2 (no-RoPE + sliding window), pp2 (no-RoPE), cp2 folded into dp (dense); in bf16
    (dense, MoE at tp2) rows may part only at a near-tie (tests/generation_checks.py).
    Before: Qwen2 had no decoder (incremental_decoder() was None) and every generation re-ran the prompt."""
    from tests.generation_checks import assert_equal_up_to_near_ties, check_cost

    _, ranks = world
    runs = {k: [r["generation"][k] for r in ranks] for k in ranks[0]["generation"]}
    runs[("dense", "cp2")] = [r["cp2"]["generation"] for r in ranks]
    assert {("dense", "tp2"), ("nope", "tp2"), ("bias", "tp2"), ("swa", "tp2"), ("moe", "tp2"),
            ("nope_swa", "tp1xdp2"), ("nope", "pp2"), ("dense", "cp2"), ("dense", "tp2-bf16"),
            ("moe", "tp2-bf16")} <= runs.keys()
    for key, gens in sorted(runs.items()):
        for gen in gens:
            assert gen["decoder"], key
            if key[1].endswith("bf16"):  # the two paths round differently: rows may part at a near-tie only
                assert_equal_up_to_near_ties(gen, str(key))
                continue
            assert gen["cached"] == gen["rerun"] and gen["cached_stop"] == gen["rerun_stop"], key
            assert not gen["divergences"] and not gen["divergences_stop"], key
            if "shared" in gen:  # prompts with a common prefix: prefilled once, then each prompt's own suffix
                assert gen["shared"]["shared_prefix"] >= 8 and gen["shared"]["cached"] == gen["shared"]["rerun"], key
        lengths = {len(tokens) for g in gens for tokens, _, _ in g["cached_stop"].values()}
        assert len(lengths) > 1, (key, lengths)  # rows finished at different steps
        cached, rerun = check_cost(gens)
        print(f"generation {key}: tokens through the embedding {cached} (cache) vs {rerun} (re-run)")


def test_context_parallelism_is_folded_into_data_parallelism(world):
    """cp2 (nanotron main's llama3 ring attention, the dense checkpoint): the live backend scores with each CP rank
    a data-parallel rank of its own (layout dp 2, cp_in_dp 2) and the ring off while scoring: scores equal the same
    weights' at cp1 (tp2), one row's logits equal the ring forward's halves, and a training-mode ring forward and
    backward after the evaluation is bitwise the one before it (the switched attributes are restored). Before: the
    backend refused cp > 1."""
    _, ranks = world
    for r in ranks:
        cp = r["cp2"]
        assert cp["layout"] == {"world_size": 2, "dp": 2, "tp": 1, "pp": 1, "cp_in_dp": 2}, cp["layout"]
        assert cp["ring_vs_backend"] < TOLERANCE, cp["ring_vs_backend"]
        assert cp["train_step_unchanged"]
        assert cp["switched_after"] == cp["switched_before"]
        assert cp["switched_before"][0] == "llama3_ring_attention"
        assert cp["switched_before"][1] == [(True, 2)] * 4  # every layer's attention rings over cp_pg again
        _same_scores(cp["scores"], ranks[0]["backend"][("dense", "tp2", "scores")])
    print(f"cp2: max |logit diff| vs the ring forward {max(r['cp2']['ring_vs_backend'] for r in ranks):.1e}")


def test_packed_rows_score_like_one_row_per_request(world):
    """Packed rows on nanotron main's Qwen2 (tests/packing_checks.py: a document's context once under nano_eval's
    tree mask with per-token RoPE positions, several documents per row, a shared few-shot prefix once): log-probs
    within 1e-5 of one row per request and the same greedy flags for every variant at tp2 (dense, no-RoPE layers, qkv
    bias, sliding window counted in positions, no-RoPE layers without the window, MoE), dense at tp1 x dp2, dense and
    no-RoPE at pp2 (with the upstream fix), and with CP folded into DP (cp2)."""
    from tests.packing_checks import assert_packing_exact

    _, ranks = world
    found = {(k[0], k[1]) for r in ranks for part in ("backend", "pp2") for k in r[part] if k[-1] == "packing"}
    assert {(v, "tp2") for v in ("dense", "nope", "bias", "swa", "nope_swa", "moe")} | {("dense", "tp1xdp2")} | {
        ("dense", "pp2"), ("nope", "pp2")} <= found, found
    for variant, layout in sorted(found):
        part = "pp2" if layout == "pp2" else "backend"
        assert_packing_exact([r[part][(variant, layout, "packing")] for r in ranks], f"{variant} {layout}", fewer=2)
    assert_packing_exact([r["cp2"]["packing"] for r in ranks], "cp2", fewer=2)


def test_pp2_on_unfixed_nanotron_main_is_refused_on_every_rank(world):
    """nanotron main cannot run Qwen2 with pp > 1 (upstream bug); both stages must raise the same error before any
    forward. Without the collective contract check, stage 1 raised and stage 0 waited on it."""
    _, ranks = world
    for r in ranks:
        message = r["pp2_unfixed"][("dense", "pp2")]
        assert message.startswith("NanoEvalError: [rank ") and "pipeline parallelism (pp=2)" in message, message
        assert "position_ids.numel()" in message and "Fix: pp=1" in message


def test_pp2_with_the_upstream_fix_is_exact(world):
    _, ranks = world
    for variant in ("dense", "nope"):
        values = _last_stage_values(ranks, "pp2", (variant, "pp2"))
        assert len(values) == 1 and values[0] < TOLERANCE, (variant, values)


def test_training_is_bitwise_identical_with_and_without_evaluation(world):
    """Every training layout of the world (dense tp2, no-RoPE dp2; with NANO_EVAL_NANOTRON_MAIN_SLOW=1 also MoE tp2,
    qkv bias dp2, sliding window tp2 and no-RoPE pp2 with the upstream pp fixes)."""
    from nano_eval.tracking.jsonl import read_jsonl

    root, ranks = world
    layouts = {(v, name) for r in ranks for v, name, _ in r["training"]}
    assert {("dense", "tp2"), ("nope", "dp2")} <= layouts
    for variant, layout in sorted(layouts):
        holders = [r["training"] for r in ranks if r["training"].get((variant, layout, "with"))]
        assert holders, f"{variant} {layout}: no rank recorded losses"
        for training in holders:
            with_eval, without = training[(variant, layout, "with")], training[(variant, layout, "without")]
            assert len(with_eval) == 4 and len(set(with_eval)) > 1, (variant, layout)
            assert with_eval == without, (variant, layout)  # exact float equality, every step
        global_batch = 2 * (2 if layout == "dp2" else 1)
        rows = read_jsonl(root / f"train_{variant}_{layout}_with" / "eval" / "eval_results.jsonl")
        assert [r["step"] for r in rows] == [2, 3, 4], (variant, layout)  # interval 2 -> 2, 4; on_save -> 3
        assert [r["consumed_tokens"] for r in rows] == [s * global_batch * 32 for s in (2, 3, 4)]  # main's metadata
        assert all(not r.get("failed") and r["results"] for r in rows), rows
        print(f"{variant} {layout}: losses {holders[0][(variant, layout, 'with')]} with and without evaluation")


def test_live_scores_equal_the_saved_checkpoints(world):
    """Step 3: dense tp2 vs run.py's transformers conversion; no-RoPE dp2 vs --backend nanotron (tp2)."""
    from nano_eval.cli import main
    from nano_eval.tracking.jsonl import read_jsonl

    root, ranks = world
    run = root / "train_dense_tp2_with"
    live = {r["step"]: r["results"] for r in read_jsonl(run / "eval" / "eval_results.jsonl")}[3]
    out = root / "posthoc_dense"
    assert main(["--checkpoint", str(run / "checkpoints" / "3"), "--tasks", ",".join(live), "--max-samples", "6",
                 "--output-dir", str(out), "--no-details"]) == 0
    import json

    saved = json.loads((out / "results.json").read_text())["results"]
    _same_metrics(live, saved)
    nope_live = {r["step"]: r["results"] for r in
                 read_jsonl(root / "train_nope_dp2_with" / "eval" / "eval_results.jsonl")}[3]
    native = ranks[0]["nope_step3_native"][("nope", "tp2", "scores")]
    _same_metrics(nope_live, {task: native[task]["metrics"] for task in nope_live})


def _same_metrics(live, saved, rel=1e-5):
    for task, metrics in live.items():
        for name, value in metrics.items():
            if not name.endswith("_stderr"):
                assert saved[task][name] == pytest.approx(value, rel=rel, abs=1e-9), (task, name)


def test_run_py_refuses_moe_by_name(world, capsys):
    """No transformers class reproduces nanotron main's MoE layer: refused naming the field and --backend nanotron
    (before: "its weights do not fit config.yaml's Llama ... Fix: restore the checkpoint", a wrong fix)."""
    from nano_eval.cli import main

    _, ranks = world
    ckpt = ranks[0]["ckpts"]["moe"]
    assert main(["--checkpoint", ckpt, "--tasks", "demo|arithmetic|0", "--max-samples", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nano_eval: error: "), err
    assert "moe_config: " in err[0] and "Qwen2Config" in err[0] and "--backend nanotron" in err[0], err[0]


# ---- config-level checks: no nanotron main needed ----------------------------------------------------------------

QWEN2_DENSE = {"is_qwen2_config": True, "attention_bias": False, "sliding_window_size": None, "no_rope_layer": None,
               "moe_config": None, "rope_seq_len_interpolation_factor": None, "rope_scaling": None,
               "z_loss_enabled": True, "_use_doc_masking": True}


@pytest.mark.parametrize("extra, field", [
    ({"moe_config": {"num_experts": 4}}, "moe_config"),
    ({"rope_seq_len_interpolation_factor": 2.0}, "rope_seq_len_interpolation_factor: 2.0"),
    ({"flex_attention_mask": "document"}, "flex_attention_mask"),
])
def test_unconvertible_qwen2_fields_are_refused_by_name(extra, field):
    from nano_eval.checkpoints.nanotron import refuse_unconvertible

    refuse_unconvertible(QWEN2_DENSE, "ckpt")  # dense Qwen2 is a Llama: accepted
    refuse_unconvertible({**QWEN2_DENSE, "no_rope_layer": 4, "attention_bias": True, "sliding_window_size": 8},
                         "ckpt")  # SmolLM3: accepted
    with pytest.raises(NanoEvalError, match="Qwen2Config") as e:
        refuse_unconvertible({**QWEN2_DENSE, **extra}, "ckpt")
    assert field in str(e.value) and "--backend nanotron" in str(e.value)


def test_llama_configs_pass_the_field_check():
    """nanotron's Llama (0.4 and main) reads none of those fields (main's LlamaConfig has an attention_bias its
    model ignores; neither reads rope_scaling): the conversion computes what it computes."""
    from nano_eval.checkpoints.nanotron import refuse_unconvertible

    refuse_unconvertible({"is_llama_config": True, "attention_bias": True, "rope_scaling": {"factor": 2.0}}, "ckpt")


def test_consumed_tokens_from_either_trainer():
    """nanotron 0.4 counts samples on the trainer; main counts tokens in `trainer.metadata` (its older checkpoints
    only samples there); before, the hook read `trainer.consumed_train_samples` and main's trainer died at step 1."""
    from types import SimpleNamespace

    from nano_eval.training.nanotron import consumed_tokens

    assert consumed_tokens(SimpleNamespace(consumed_train_samples=6, sequence_length=32)) == 192  # 0.4
    main = SimpleNamespace(sequence_length=32, metadata=SimpleNamespace(consumed_train_samples=6,
                                                                        consumed_tokens_total=200))
    assert consumed_tokens(main) == 200
    main.metadata.consumed_tokens_total = None
    assert consumed_tokens(main) == 192


def test_backend_nanotron_on_a_qwen2_checkpoint_without_nanotron_main_says_how_to_install_it(tmp_path, capsys,
                                                                                         monkeypatch):
    """Before: nanotron 0.4's config parser failed on main's Qwen2 fields with its own message. (Where main is
    installed, the test pretends it is not.)"""
    import nano_eval.compat.nanotron as compat
    from nano_eval.cli import main

    monkeypatch.setattr(compat, "has_qwen2", lambda: False)
    ckpt = tmp_path / "qwen2_ckpt"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "config.yaml").write_text("model: {model_config: {is_qwen2_config: true}}\ntokenizer: "
                                      "{tokenizer_name_or_path: x}\n")
    assert main(["--checkpoint", str(ckpt), "--backend", "nanotron", "--tasks", "demo|arithmetic|0",
                 "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nanotron main's Qwen2" in err[0] and "2411b022" in err[0], err


def test_qwen2_generation_reruns_the_prompt_where_the_cache_is_refused(capsys):
    """Under tp_mode REDUCE_SCATTER (the states between TP ranks are split along the tokens) the backend hands out no
    Qwen2 decoder, says why once, and does not share prompt prefixes; a Qwen2 without the packed-qkv attention is
    refused by name."""
    from types import SimpleNamespace

    from nano_eval.backends.nanotron import NanotronModel
    from nano_eval.backends.nanotron_qwen2_cache import unsupported_reason
    from nano_eval.compat.nanotron import QWEN2
    from nano_eval.parallel import ParallelLayout

    backend = NanotronModel.__new__(NanotronModel)  # the fields incremental_decoder reads, no model
    backend.family, backend.seq_multiple, backend.layout = QWEN2, 2, ParallelLayout()
    backend.forward_module = SimpleNamespace(config=SimpleNamespace(_use_qkv_packed=True))
    assert backend.incremental_decoder() is None
    err = capsys.readouterr().err
    assert "without a KV cache (tp_mode REDUCE_SCATTER)" in err, err
    backend.seq_multiple = 1
    assert unsupported_reason(backend) is None
    backend.forward_module.config._use_qkv_packed = False
    assert "_use_qkv_packed: false" in unsupported_reason(backend)
