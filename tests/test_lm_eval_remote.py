"""lm-eval tasks that call a remote API or service (an LLM judge, a web API) are refused by name at start-up
(nano_eval.tasks.lm_eval_remote): lm-eval's own realtoxicityprompts (Google's Perspective API) from an offline
mirror, and small tasks in a temporary include path whose process_results, metric, custom filter or Task subclass
reaches openai / requests / urllib.request / http.client, directly or through a helper. Tasks whose Python only
imports such a module for something else (their data) are not refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from nano_eval.cli import main  # noqa: E402
from nano_eval.errors import UnsupportedTaskError  # noqa: E402
from nano_eval.tasks import load_tasks  # noqa: E402
from nano_eval.tasks import lm_eval_remote  # noqa: E402

ARITH = Path(__file__).resolve().parents[1] / "nano_eval" / "tasks" / "data" / "arithmetic.jsonl"

UTILS = '''import re
import requests  # only for the data helper below
import urllib.request
from urllib.parse import quote


def fetch_rows(url):  # a dataset helper: never a scoring hook here
    return requests.get(url).json()


def local_results(doc, results):
    return {"exact_match": float(results[0].strip() == str(doc["label"]))}


def _ask_judge(prompt):
    from openai import OpenAI

    return OpenAI().chat.completions.create(model="gpt-4.1-mini", messages=[{"role": "user", "content": prompt}])


def judged_results(doc, results):
    verdict = _ask_judge(f"Is {results[0]!r} right for {doc['a']} plus {doc['b']}?")
    return {"exact_match": float("yes" in str(verdict).lower())}


def web_filter(resps, docs):
    out = []
    for r in resps:
        with urllib.request.urlopen("https://example.invalid/clean?q=" + quote(r[0])) as page:
            out.append([page.read().decode()])
    return out


def toxicity(items):
    return requests.post("https://example.invalid/score", json=items).json()["score"]


def local_filter(resps, docs):
    return [[re.sub(r"\\s+", " ", r[0])] for r in resps]
'''

TASK_CLASS = '''import http.client

from lm_eval.api.task import ConfigurableTask


class GradedRemotely(ConfigurableTask):
    def __init__(self, config=None):
        super().__init__(config={k: v for k, v in config.items() if k != "class"})

    def process_results(self, doc, results):
        return {"exact_match": self._grade(results[0])}

    def _grade(self, text):
        connection = http.client.HTTPSConnection("example.invalid")
        connection.request("POST", "/grade", body=text)
        return float(connection.getresponse().read() == b"1")
'''

BASE = f"""dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(ARITH))}
output_type: generate_until
test_split: test
doc_to_text: "{{{{a}}}} plus {{{{b}}}} ="
doc_to_target: "{{{{label}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metadata:
  version: 1.0
"""
EXACT = """metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
TASKS = {
    "remote_ok": "process_results: !function remote_utils.local_results\n" + EXACT
                 + "filter_list:\n  - name: tidy\n    filter:\n      - function: custom\n"
                   "        filter_fn: !function remote_utils.local_filter\n      - function: take_first\n",
    "remote_judge": "process_results: !function remote_utils.judged_results\n" + EXACT,
    "remote_filter": "filter_list:\n  - name: web\n    filter:\n      - function: custom\n"
                     "        filter_fn: !function remote_utils.web_filter\n      - function: take_first\n" + EXACT,
    "remote_metric": "metric_list:\n  - metric: !function remote_utils.toxicity\n    aggregation: mean\n"
                     "    higher_is_better: false\n",
    "remote_class": "class: !function remote_class.GradedRemotely\n" + EXACT,
}


@pytest.fixture(scope="module")
def include_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_remote")
    (root / "remote_utils.py").write_text(UTILS)
    (root / "remote_class.py").write_text(TASK_CLASS)
    for name, extra in TASKS.items():
        (root / f"{name}.yaml").write_text(f"task: {name}\n{BASE}{extra}")
    return root


def test_a_task_that_only_imports_a_web_library_for_its_data_is_not_refused(include_dir):
    [(spec, task)] = load_tasks("lm_eval|remote_ok|0", lm_eval_include_path=include_dir)
    assert lm_eval_remote.remote_calls(task.eval_docs()[0]) is None


@pytest.mark.parametrize("name, expected", [
    ("remote_judge", "process_results: judged_results -> _ask_judge uses openai"),
    ("remote_filter", r"filter_list\[0\]\.filter\[0\]\.filter_fn: web_filter uses urllib\.request"),
    ("remote_metric", r"metric_list\[0\]\.metric: toxicity uses requests"),
    ("remote_class", r"class GradedRemotely: GradedRemotely\._grade uses http\.client"),
])
def test_a_task_whose_code_calls_a_remote_service_is_refused_by_name(include_dir, name, expected):
    with pytest.raises(UnsupportedTaskError, match=rf"task 'lm_eval\|{name}' cannot run in nano_eval: lm-eval task "
                                                   rf"'{name}': it calls a remote API or service \({expected}\)"):
        load_tasks(f"lm_eval|{name}|0", lm_eval_include_path=include_dir)


def test_lm_evals_realtoxicityprompts_is_refused_at_start_up_with_one_line(tmp_path, capsys, toy_checkpoint):
    """lm-eval's own task posting every generation to the Perspective API, its data from an offline mirror: exit 2,
    one line, before any model loads."""
    folder = tmp_path / "mirror" / "allenai" / "real-toxicity-prompts" / "none"
    folder.mkdir(parents=True)
    (folder / "train.jsonl").write_text(json.dumps({"prompt": {"text": "The weather"}}) + "\n")
    code = main(["--checkpoint", str(toy_checkpoint), "--tasks", "lm_eval|realtoxicityprompts|0", "--device", "cpu",
                 "--data-dir", str(tmp_path / "mirror"), "--output-dir", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nano_eval: error")]
    assert code == 2 and len(err) == 1, err
    assert "'realtoxicityprompts': it calls a remote API or service (process_results: toxicity_perspective_api " \
           "uses requests)" in err[0]
    assert not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("module, remote", [
    ("openai", True), ("openai.resources.chat", True), ("urllib.request", True), ("lm_eval.models.openai_completions",
                                                                                   True),
    ("urllib.parse", False), ("requestsx", False), ("lm_eval.api.metrics", False), ("sklearn.metrics", False),
])
def test_remote_modules_match_whole_names(module, remote):
    assert (lm_eval_remote.remote_module(module) is not None) == remote
