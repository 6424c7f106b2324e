"""A sweep's identity covers --lm-eval-include-path: the folder and a fingerprint of the task files in it
(nano_eval.sweep.identity.lm_eval_sources, read by nano_eval.local_files' rule), so results scored with other
YAMLs are never reused; sweeps without an include path keep the identity they had.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from nano_eval.errors import NanoEvalError
from nano_eval.evaluator import EvalConfig
from nano_eval.job import EvalJob
from nano_eval.local_files import LocalFileError
from nano_eval.sweep.identity import evaluation_identity, identity_settings, lm_eval_sources

ARITH = Path(__file__).resolve().parents[1] / "nano_eval" / "tasks" / "data" / "arithmetic.jsonl"
TASK = f"""task: nano_id_mc
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {json.dumps(str(ARITH))}
output_type: multiple_choice
validation_split: validation
doc_to_text: !function prompts.question
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""
PROMPTS = 'def question(doc):\n    return f"{doc[\'a\']} plus {doc[\'b\']} ="\n'


def _include(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "nano_id_mc.yaml").write_text(TASK)
    (folder / "prompts.py").write_text(PROMPTS)
    return folder


def _identity(include: Path | None) -> str:
    job = EvalJob(tasks="lm_eval|nano_id_mc|0", lm_eval_include_path=None if include is None else str(include),
                  eval=EvalConfig(max_samples=4))
    return evaluation_identity(job, ["lm_eval|nano_id_mc|0"], {"lm_eval|nano_id_mc|0": 1}, "fp")


def test_the_identity_changes_with_the_folder_and_its_task_files_only(tmp_path):
    a = _include(tmp_path / "a")
    first = _identity(a)
    assert _identity(a) == first
    (a / "rows.jsonl").write_text("{}\n")  # not a task file (data is named by --data-dir or the YAML's path)
    (a / "__pycache__").mkdir()
    (a / "__pycache__" / "prompts.cpython-311.pyc.yaml").write_text("cache")
    assert _identity(a) == first
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert _identity(b) != first  # the same files elsewhere: another include path
    (a / "nano_id_mc.yaml").write_text(TASK.replace("version: 1.0", "version: 1.0  # edited"))
    edited = _identity(a)
    assert edited != first
    (a / "prompts.py").write_text(PROMPTS.replace(" =", " equals"))  # a `!function` hook changes the prompts
    assert _identity(a) != edited
    (a / "sub").mkdir()
    (a / "sub" / "_template_yaml").write_text("output_type: multiple_choice\n")  # an included template
    assert len({first, edited, _identity(a)}) == 3


def test_without_an_include_path_the_identity_is_what_it_was():
    job = EvalJob(tasks="demo|arithmetic|0", eval=EvalConfig(max_samples=6))
    assert not any(key.startswith("lm_eval") for key in identity_settings(job, ["demo|arithmetic|0"], {}))
    assert lm_eval_sources(None) == {}


def test_links_inside_count_as_their_target_links_out_and_fifos_are_refused(tmp_path):
    a = _include(tmp_path / "a")
    (a / "shared").mkdir()
    (a / "shared" / "common.yaml").write_text("x: 1\n")
    (a / "alias.yaml").symlink_to(a / "shared" / "common.yaml")
    before = lm_eval_sources(str(a))["lm_eval_include_fingerprint"]
    (a / "shared" / "common.yaml").write_text("x: 2\n")  # the link's target changed
    assert lm_eval_sources(str(a))["lm_eval_include_fingerprint"] != before
    outside = tmp_path / "outside.yaml"
    outside.write_text("x: 1\n")
    (a / "leak.yaml").symlink_to(outside)
    with pytest.raises(LocalFileError, match=r"leak\.yaml: leads outside .*Fix: keep only real task files"):
        lm_eval_sources(str(a))
    (a / "leak.yaml").unlink()
    os.mkfifo(a / "pipe.yaml")  # would block a plain open()
    with pytest.raises(LocalFileError, match=r"pipe\.yaml: is a FIFO, not a regular file"):
        lm_eval_sources(str(a))


def test_a_sweep_with_edited_yamls_is_refused_instead_of_reusing_results(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from nano_eval.cli import main
    from tests.sweep_utils import one_thread, save_hf_checkpoint, toy_parts

    tokenizer, model = toy_parts()
    run = tmp_path / "run"
    save_hf_checkpoint(model, tokenizer, run / "checkpoint-8", 8)
    include, out = _include(tmp_path / "include"), tmp_path / "out"

    def sweep(folder: Path) -> int:
        with one_thread():
            return main(["--checkpoint", str(run), "--tasks", "lm_eval|nano_id_mc|0", "--max-samples", "3",
                         "--settle-s", "0", "--lm-eval-include-path", str(folder), "--output-dir", str(out),
                         "--device", "cpu"])

    assert sweep(include) == 0
    assert sweep(include) == 0 and "0 evaluated, 1 reused" in capsys.readouterr().out
    (include / "prompts.py").write_text(PROMPTS.replace(" =", " equals"))  # other prompts: other scores
    assert sweep(include) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nano_eval: error")]
    assert len(err) == 1 and "holds a sweep evaluated with other settings: lm_eval_include_fingerprint" in err[0]
