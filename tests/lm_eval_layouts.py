"""lm-evaluation-harness tasks across parallel layouts: the custom task YAMLs, a summary of one evaluation and the
comparison the layout tests use (tests/test_nanotron.py, tests/test_megatron_moe.py, tests/test_nanotron_trainer.py,
tests/test_lm_eval_tasks.py).

The tasks are small lm-eval YAMLs over the repository's arithmetic data, read offline from a folder passed as
`--lm-eval-include-path`: a multiple-choice task at 2 shots (loglikelihood requests with few-shot contexts), a greedy
generation task at 1 shot with two regex filters (generate_until: the KV-cache decoder), and rolling perplexity over
documents longer than the model (loglikelihood_rolling, several windows). Importable in spawned ranks (no pytest).
"""

from __future__ import annotations

import math
from pathlib import Path

from nano_eval.tasks import lm_eval_examples as examples

# the layout tests' tasks: few-shot multiple choice, filtered greedy generation, rolling perplexity
SPECS = "lm_eval|nano_toy_mc|2,lm_eval|nano_toy_gen|1,lm_eval|nano_toy_ppl|0"
EXACT = ("acc", "acc_norm", "exact_match")  # counts of right answers: equal, not close


def write_include_dir(root: Path) -> Path:
    """The tests' lm-eval tasks as YAMLs in `root` (created; returns it; nano_eval.tasks.lm_eval_examples): the three
    of SPECS, a second multiple-choice task with Matthews' correlation, a group of the two with
    `aggregate_metric_list`, and a sampled generation task (which nano_eval refuses). One folder for the whole test
    session: lm-eval indexes its ~15k tasks (7-9 s) once per process and include path."""
    return examples.write_include_dir(
        root, examples.multiple_choice("nano_toy_mc"),
        examples.multiple_choice("nano_toy_mc_b", "{{a}} + {{b}} =", metrics=("acc", "acc_norm", "mcc")),
        examples.generation("nano_toy_gen"), examples.rolling_perplexity("nano_toy_ppl"),
        examples.group("nano_toy_group", ["nano_toy_mc", "nano_toy_mc_b"]),
        examples.generation("nano_toy_sampled", do_sample=True, temperature=0.7))


def summarize(backend, include_dir, batch_tokens: int, max_samples: int, specs: str = SPECS) -> dict:
    """Evaluate lm-eval specs with any backend: {results key: {"metrics" (stderrs left out), "rows": per document and
    filter, its request strings (`arguments`: contexts with their few-shot examples), raw answers (`resps`: (log-prob,
    is-greedy) pairs, rolling log-likelihoods, generated texts) and filtered answers}}."""
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import load_tasks

    tasks = load_tasks(specs, lm_eval_include_path=str(include_dir))
    config = EvalConfig(max_samples=max_samples, batching=BatchingConfig(max_batch_tokens=batch_tokens),
                        progress=False)
    results = Evaluator(backend, tasks, config).evaluate()
    assert not results.failed, results.failed
    return {key: {"metrics": {k: v for k, v in tr.metrics.items() if "_stderr" not in k},
                  "rows": [{k: row[k] for k in ("doc_index", "filter", "arguments", "resps", "filtered_resps")}
                           for row in tr.details]}
            for key, tr in results.tasks.items()}


def built_alone(include_dir, max_samples: int, specs: str = SPECS) -> dict:
    """{results key: {doc_id: request strings}} of lm-eval specs built in this process, a world of one, no model:
    what every rank of every layout must score (few-shot contexts that depend on the data-parallel size are lm-eval
    issue #1719)."""
    from nano_eval.tasks import load_tasks

    out = {}
    for spec, task in load_tasks(specs, lm_eval_include_path=str(include_dir)):
        built, _ = task.build_requests(spec.num_fewshot, max_samples=max_samples)
        (leaf,) = built.leaves  # SPECS names tasks, not groups
        out[spec.key] = {doc_id: [[a for a in inst.args if isinstance(a, str)] for inst in group]
                         for doc_id, group in leaf.docs}
    return out


def assert_built_alone(summary: dict, alone: dict) -> None:
    """Every document of `summary` was scored on the request strings a world of one builds (built_alone)."""
    assert list(summary) == list(alone)
    for key, rows in ((k, v["rows"]) for k, v in summary.items()):
        assert {row["doc_index"] for row in rows} == set(alone[key]), key
        for row in rows:
            assert row["arguments"] == alone[key][row["doc_index"]], (key, row["doc_index"])


def _close_answers(a, b, tol: float) -> bool:
    """One answer of lm-eval's hf model's shape: (log-prob, is_greedy), a rolling log-likelihood (a total over
    hundreds of tokens: compared relative to max(1, |x|)) or a text."""
    if isinstance(b, (list, tuple)) and len(b) == 2 and isinstance(b[1], bool):
        return abs(a[0] - b[0]) <= tol and bool(a[1]) == b[1]
    if isinstance(b, float):
        return abs(a - b) <= tol * max(1.0, abs(b))
    return a == b


def worst_logprob_gap(got: dict, ref: dict) -> float:
    """The largest log-prob difference between two summaries (rolling totals relative to max(1, |x|))."""
    worst = 0.0
    for key in ref:
        for row, ref_row in zip(got[key]["rows"], ref[key]["rows"], strict=True):
            for mine, its in zip(row["resps"], ref_row["resps"], strict=True):
                a, b = mine[0], its[0]
                if isinstance(b, (list, tuple)):
                    worst = max(worst, abs(a[0] - b[0]))
                elif isinstance(b, float):
                    worst = max(worst, abs(a - b) / max(1.0, abs(b)))
    return worst


def assert_same_lm_eval(got: dict, ref: dict, what: str, tol: float = 1e-5) -> None:
    """`got` scores like `ref` (two summaries): the same tasks, documents and request strings (few-shot contexts
    included: they must not depend on the layout or the data-parallel size), per-request log-probs within `tol`,
    the same is-greedy flags, generations and filtered answers, equal accuracies and exact matches, and the other
    metric values (perplexities) within 1e-6 relative."""
    assert list(got) == list(ref), (what, list(got), list(ref))
    for key in ref:
        rows, ref_rows = got[key]["rows"], ref[key]["rows"]
        assert len(rows) == len(ref_rows) > 0, (what, key)
        for row, ref_row in zip(rows, ref_rows):
            where = (what, key, row["doc_index"], row["filter"])
            assert (row["doc_index"], row["filter"]) == (ref_row["doc_index"], ref_row["filter"]), where
            assert row["arguments"] == ref_row["arguments"], (*where, "request strings differ")
            for mine, its in zip(row["resps"], ref_row["resps"], strict=True):
                assert _close_answers(mine[0], its[0], tol), (*where, mine, its)
            for mine, its in zip(row["filtered_resps"], ref_row["filtered_resps"], strict=True):
                assert _close_answers(mine, its, tol), (*where, mine, its)
        metrics, ref_metrics = got[key]["metrics"], ref[key]["metrics"]
        assert set(metrics) == set(ref_metrics), (what, key)
        for name, value in ref_metrics.items():
            if name.split(",")[0] in EXACT or math.isnan(value):
                assert metrics[name] == value or (math.isnan(value) and math.isnan(metrics[name])), \
                    (what, key, name, metrics[name], value)
            else:
                assert math.isclose(metrics[name], value, rel_tol=1e-6), (what, key, name, metrics[name], value)


def assert_opinionated(ref: dict) -> None:
    """The comparisons can fail: choices' log-probs are far apart, several shots per context, generations are not
    all empty, rolling documents are scored."""
    mc = ref["lm_eval|nano_toy_mc|2"]["rows"]
    assert max(max(r[0][0] for r in row["resps"]) - min(r[0][0] for r in row["resps"]) for row in mc) > 0.5
    assert all(row["arguments"][0][0].count("Answer:") == 3 for row in mc)  # 2 shots + the question
    gen = ref["lm_eval|nano_toy_gen|1"]["rows"]
    assert sum(bool(row["resps"][0][0].strip()) for row in gen) > len(gen) // 2
    assert all(row["resps"][0][0] < 0 for row in ref["lm_eval|nano_toy_ppl|0"]["rows"])
