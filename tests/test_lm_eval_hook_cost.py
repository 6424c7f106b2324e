"""The per-call cost of lm_eval|... tasks in an evaluation outside the forwards (scripts/profile_lm_eval_hook.py
profiles it): lm-eval compiled every Jinja template again for every document, at build time and in
process_results at every evaluation (~90% of its share of a hook call on the toy model); nano_eval compiles each
template once (lm_eval_tasks._compiled_templates) and renders the same strings (the parity tests in
tests/test_lm_eval_tasks.py compare every request string and metric with lm-eval's own run).
"""

from __future__ import annotations


import pytest

pytest.importorskip("lm_eval")

from nano_eval.evaluator import EvalConfig, Evaluator  # noqa: E402
from nano_eval.tasks import lm_eval_examples as examples  # noqa: E402
from nano_eval.tasks import load_tasks  # noqa: E402

TASK = examples.multiple_choice("nano_cost_mc", "{{a}} plus {{b}} =", metrics=("acc",), few_shot=False,
                                doc_to_target="{{label}}")


def test_each_template_is_compiled_once_not_per_document_and_evaluation(tmp_path, toy_backend, monkeypatch):
    from lm_eval import utils

    examples.write_include_dir(tmp_path, TASK)
    compiled: list[str] = []
    from_string = utils.env.from_string

    def counting(source, *args, **kwargs):
        compiled.append(source)
        return from_string(source, *args, **kwargs)

    monkeypatch.setattr(utils.env, "from_string", counting)
    tasks = load_tasks("lm_eval|nano_cost_mc|0", lm_eval_include_path=tmp_path)
    evaluator = Evaluator(toy_backend, tasks, EvalConfig(max_samples=10, progress=False))
    assert len(compiled) == len(set(compiled)) <= 3, compiled  # text, choices, target: once each
    built = len(compiled)
    first = evaluator.evaluate()
    second = evaluator.evaluate()
    assert len(compiled) == built  # process_results renders the target and choices again, compiling nothing
    assert first.tasks["lm_eval|nano_cost_mc|0"].details == second.tasks["lm_eval|nano_cost_mc|0"].details
    assert utils.apply_template.__module__ == "lm_eval.utils"  # lm-eval's own function outside nano_eval's calls
