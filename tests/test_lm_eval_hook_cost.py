"""The per-call cost of lm_eval|... tasks in an evaluation outside the forwards (scripts/profile_lm_eval_hook.py
profiles it): lm-eval compiled every Jinja template again for every document, at build time and in
process_results at every evaluation (~90% of its share of a hook call on the toy model); nano_eval compiles each
template once (lm_eval_tasks._compiled_templates) and renders the same strings (the parity tests in
tests/test_lm_eval_tasks.py compare every request string and metric with lm-eval's own run).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from nano_eval.evaluator import EvalConfig, Evaluator  # noqa: E402
from nano_eval.tasks import load_tasks  # noqa: E402

ARITH = Path(__file__).resolve().parents[1] / "nano_eval" / "tasks" / "data" / "arithmetic.jsonl"
TASK = f"""task: nano_cost_mc
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {json.dumps(str(ARITH))}
output_type: multiple_choice
validation_split: validation
doc_to_text: "{{{{a}}}} plus {{{{b}}}} ="
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def test_each_template_is_compiled_once_not_per_document_and_evaluation(tmp_path, toy_backend, monkeypatch):
    from lm_eval import utils

    (tmp_path / "nano_cost_mc.yaml").write_text(TASK)
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
