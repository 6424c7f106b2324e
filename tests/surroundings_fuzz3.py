"""Fuzz the inputs issue 44 found open: an `--lm-eval-include-path` folder (its YAMLs, included templates and
Python, and so the metric outputs of its task code), and the sweep tables `nano_eval compare` reads from other runs.

    python -m tests.surroundings_fuzz3 {include,tables} WORK_DIR REPORT.json [--seed S] [--cases N]

Runs in its own process, under an address-space limit (its size after imports + 4 GiB) and a per-case alarm
(tests/fuzz_case.py), like the other fuzzes.

include: every case is a genuine include folder (a multiple-choice task whose process_results is Python of the
folder, a generation task with regex filters, a rolling-perplexity task, a task that includes a template through
`../`) next to an `outside` folder (a task YAML, a template, and a module that leaves a marker if it ever runs), with
one seeded mutation: byte flips or truncation of a YAML, the template or the Python; a FIFO, a folder, a sparse
8 GiB file or a symlink (out, or to a copy inside) in place of a file; a hostile value in a task's YAML (Jinja
bombs and a template reaching `os.system`, generation_kwargs of the wrong type or size, `include:` of a FIFO, of a
file outside or of itself, `!function` naming a file outside, an installed module or lm-eval's catalogue, an alias
bomb, deep nesting, names with terminal escapes); or the Python's process_results returning NaN, inf, None, text,
a huge dict, calling sys.exit, importing a socket by a literal or computed name, or exiting at import. The case
loads the tasks as the training hook does (fail_soft: a task that cannot load is left out), builds one Evaluator per
task on the toy model (the first 3 documents) and scores it.
  refused    the folder (or every task) refused in one line (a NanoEvalError)
  failed     some task refused at load or build, or failed while scored, in one line; the others scored
  scored     every task scored; every metric a finite number (a stderr may be NaN: none)
  outside    the marker exists, or the outside folder changed                                    -> defect
  wrong      a non-finite metric in the results, a control character in the results table or an error line,
             an error message of several lines                                                   -> defect
  memory / crash / timeout                                                                        -> defect

tables: every case is two sweep output folders (two runs, three tasks, names with escapes and `$`, five
checkpoints) next to a victim folder, with one seeded mutation of the second run's sweep_results.csv: byte flips,
truncation, a cell replaced by a hostile value (inf, nan, 1e999, 10^300, a negative stderr, text, 200k characters,
escapes), rows duplicated or dropped, columns added or removed, extra fields, CRLF, NUL, a BOM, a FIFO, a symlink to
the victim, a sparse 8 GiB file, a folder in its place. The case runs `nano_eval compare` on the two folders.
  refused    exit code 2 and one error line naming the table, with a Fix
  compared   exit code 0; compare.csv and compare_signal.csv hold finite numbers only; nothing printed or written
             to the page carries a raw ESC
  outside    the victim folder changed                                                          -> defect
  wrong      any other exit code, several error lines, a non-finite number, a raw ESC         -> defect
  memory / crash / timeout                                                                        -> defect
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shutil
from pathlib import Path

import yaml

from tests.fuzz_case import crash as _crash, fuzz_main, run_cases, snapshot

CASE_ALARM_S = 60
CAP_BYTES = 4 << 30
ESC = "\x1b[31mred\nnano_eval: error: forged $\\x^$"
SPECS = ("lm_eval|f_mc|0", "lm_eval|f_gen|0", "lm_eval|f_ppl|0", "lm_eval|f_inc|0")
UTILS = '''def mc_results(doc, results):
    best = max(range(len(results)), key=lambda i: results[i][0])
    return {"acc": float(best == doc["label"])}
'''
TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "{{ 'x' * 10**10 }}",
    "{{ range(100000)|list * 1000 }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "{{ a ",
    "{{ ''.__class__.__mro__ }}", "{{ 9 ** 9 ** 9 }}", "{{ '%999999999d' % 1 }}", "{{ lipsum(10**6) }}",
    "{{ undefined_name }}", "{{ a }} plus {{ b }}", "{{ choices }}", "[{{ a }}, {{ b }}]", "", "{{ choices * 3 }}",
]


def _one_line(text: str) -> tuple[str, str] | None:
    """("wrong", why) when an error text is not one printable line."""
    if "\n" in text or "\x1b" in text:
        return "wrong", f"an error of several lines or with a raw escape: {text[:300]!r}"
    return None


# ---- include folders ----------------------------------------------------------------------------------------------

def _dump(config: dict, extra: str = "") -> str:
    return yaml.safe_dump(config, sort_keys=False) + extra


def build_include_world(case: Path) -> dict:
    from nano_eval.tasks.lm_eval_examples import generation, multiple_choice, rolling_perplexity

    root, outside = case / "include", case / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    marker = outside / "RAN"
    (outside / "mod.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
                                    "def pr(doc, results):\n    return {'acc': 1.0}\n")
    (outside / "task.yaml").write_text(_dump(multiple_choice("f_out")))
    (outside / "template.yaml").write_text(_dump({"output_type": "multiple_choice"}))
    (root / "utils.py").write_text(UTILS)
    (root / "mc.yaml").write_text(_dump(multiple_choice("f_mc", few_shot=False), "process_results: !function "
                                        "utils.mc_results\n"))
    (root / "gen.yaml").write_text(_dump(generation("f_gen", max_gen_toks=4)))
    (root / "ppl.yaml").write_text(_dump(rolling_perplexity("f_ppl")))
    (root / "_template").write_text(_dump({"output_type": "multiple_choice", "doc_to_choice": "{{choices}}"}))
    included = {k: v for k, v in multiple_choice("f_inc", few_shot=False).items()
                if k not in ("output_type", "doc_to_choice")}
    (root / "sub" / "inc.yaml").write_text(_dump({**included, "include": "../_template"}))
    return {"root": root, "outside": outside, "marker": marker}


def include_files(world) -> list[Path]:
    root = world["root"]
    return [root / "mc.yaml", root / "gen.yaml", root / "ppl.yaml", root / "_template", root / "sub" / "inc.yaml",
            root / "utils.py"]


def inc_flip(world, rng) -> str:
    from tests.surroundings_fuzz2 import flip

    return flip(rng.choice(include_files(world)), rng)


def inc_truncate(world, rng) -> str:
    from tests.surroundings_fuzz2 import truncate

    return truncate(rng.choice(include_files(world)), rng)


def inc_special(world, rng) -> str:
    """A FIFO, a folder or a sparse 8 GiB file in place of a file, or a FIFO named *.yaml next to the tasks."""
    path = rng.choice(include_files(world))
    kind = rng.choice(["fifo", "folder", "sparse", "new fifo"])
    if kind == "new fifo":
        os.mkfifo(world["root"] / "sub" / "evil.yaml")
        return "fifo sub/evil.yaml"
    if kind == "sparse":
        with path.open("r+b") as fh:
            fh.truncate(8 << 30)
    else:
        path.unlink()
        os.mkfifo(path) if kind == "fifo" else path.mkdir()
    return f"{kind} {path.relative_to(world['root'])}"


def inc_link(world, rng) -> str:
    """A file replaced by a symlink: out of the folder (to a copy), or to a copy inside, next to it (a YAML's
    `include:` and `!function` resolve next to the file a link points to, as in lm-eval)."""
    path = rng.choice(include_files(world))
    if rng.random() < 0.5:
        target = world["outside"] / f"copy_{path.name}"
        where = "outside"
    else:
        target = path.parent / f"{path.name}.real"
        where = "inside"
    shutil.copy(path, target)
    path.unlink()
    path.symlink_to(target)
    return f"link {path.relative_to(world['root'])} -> {where}"


def inc_yaml(world, rng) -> str:
    """One hostile value in a task YAML (appended: the last key wins, as in lm-eval's loader)."""
    root, outside = world["root"], world["outside"]
    path = rng.choice([root / "mc.yaml", root / "gen.yaml", root / "ppl.yaml", root / "sub" / "inc.yaml"])
    choice = rng.randrange(9)
    if choice == 0:
        key = rng.choice(["doc_to_text", "doc_to_choice", "doc_to_target"])
        value = rng.choice(TEMPLATES + [f"{{{{ cycler.__init__.__globals__.os.system('touch {world['marker']}') }}}}"])
        line = f"{key}: {json.dumps(value)}\n"
    elif choice == 1:
        key = rng.choice(["until", "max_gen_toks", "temperature", "do_sample", "num_beams"])
        value = rng.choice({"until": [5, "x" * 5000, [f"s{i}" for i in range(rng.choice([300, 3000]))], None,
                                      {"a": 1}, [["\n"]], ""],
                            "max_gen_toks": ["abc", -1, 10 ** 12, 1.5, True, "32", 0],
                            "temperature": ["abc", -1, 0.7, None, [1]],
                            "do_sample": ["no", 1, True, None],
                            "num_beams": ["x", 4, -2]}[key])
        settings = json.dumps({"until": ["\n"], key: value})
        line = f"generation_kwargs: {settings}\n"
    elif choice == 2:
        os.mkfifo(root / "fifo_template")
        target = rng.choice(["fifo_template", "../outside/template.yaml", str(outside / "template.yaml"),
                             "missing_template", path.name, "nul\0name", "x" * 5000])
        line = f"include: {json.dumps(target)}\n"
    elif choice == 3:
        target = rng.choice([f"{outside}/mod.pr", "os.system", "utils.missing", "missing_module.fn",
                             "lm_eval.tasks.hellaswag.utils.process_docs", "../outside/mod.pr", "builtins.exec",
                             "utils", "utils.mc_results", '"nul\\0name.fn"'])
        line = f"process_results: !function {target}\n"
    elif choice == 4:
        bomb = ["  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"] + [
            f"  a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, rng.choice([3, 9]))]
        line = "metadata:\n" + "\n".join(bomb) + "\n"
    elif choice == 5:
        line = "nested: " + "[" * rng.choice([50, 70, 100_000]) + "]" * rng.choice([0, 50]) + "\n"
    elif choice == 6:
        line = f"filter_list: {json.dumps([{'name': ESC, 'filter': [{'function': 'take_first'}]}])}\n"
    elif choice == 7:
        line = f"metric_list: {json.dumps([{'metric': rng.choice([ESC, 'acc', 'exact_match', 'bleu', 5])}])}\n"
    else:
        key = rng.choice(["output_type", "num_fewshot", "repeats", "test_split", "dataset_kwargs", "task"])
        value = rng.choice(["generate_until", "x", -1, 5, None, {"data_files": "/nonexistent"}, [], ESC])
        line = f"{key}: {json.dumps(value)}\n"
    with path.open("a") as fh:
        fh.write(line)
    return f"yaml {path.relative_to(root)}: {line[:100]!r}"


def inc_python(world, rng) -> str:
    """utils.py's process_results returning garbage, exiting, or reaching a socket; or exiting at import."""
    body = rng.choice([
        "return {'acc': float('nan')}", "return {'acc': float('nan') if doc['b'] % 2 else 1.0}",
        "return {'acc': float('inf')}", "return {'acc': None}", "return {'acc': 'x'}", "return None",
        "return {'acc': [1, 2]}", "return {f'm{i}': 1.0 for i in range(1000)}", "import sys; sys.exit(0)",
        "raise ValueError('broken metric')", "s = __import__('socket'); return {'acc': 1.0}",
        "import importlib; importlib.import_module('sock' + 'et'); return {'acc': 1.0}",
        "return {'acc': 10 ** 400}", "return {'\\x1b[2Jacc': 1.0}",
    ])
    if rng.random() < 0.15:
        text = "import sys\nsys.exit(7)\n" + UTILS
        what = "exit at import"
    else:
        text = f"def mc_results(doc, results):\n    {body}\n"
        what = body
    (world["root"] / "utils.py").write_text(text)
    return f"python {what}"


INCLUDE_MUTATIONS = [inc_flip, inc_truncate, inc_special, inc_link, inc_yaml, inc_yaml, inc_yaml, inc_python,
                     inc_python]


def include_steps(world, backend) -> tuple[str, str]:
    """Load, build and score the folder's tasks as the training hook does (fail_soft)."""
    from nano_eval.errors import BadDocumentError, NanoEvalError
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import load_tasks

    bad: dict[str, str] = {}
    try:
        tasks = load_tasks(",".join(SPECS), lm_eval_include_path=str(world["root"]), bad_documents=bad)
    except NanoEvalError as e:
        return _one_line(str(e)) or ("refused", str(e))
    failed = dict(bad)
    scored = {}
    for spec, task in tasks:
        try:
            ev = Evaluator(backend, [(spec, task)], EvalConfig(max_samples=3, lm_eval_bootstrap_iters=0,
                                                               progress=False))
        except (BadDocumentError, NanoEvalError) as e:  # refused when its requests were built
            failed[spec.key] = str(e)
            continue
        results = ev.evaluate()
        failed.update(results.failed)
        for key, tr in results.tasks.items():
            scored[key] = tr.metrics
            for name, value in tr.metrics.items():
                if not math.isfinite(value) and not (math.isnan(value) and "_stderr" in name):
                    return "wrong", f"{key} {name} = {value}"
        table = results.table()
        if any(ch in table for ch in "\x1b\r") or any(line.startswith("nano_eval:") for line in table.splitlines()):
            return "wrong", f"control characters in the results table: {table[:300]!r}"
    for why in failed.values():
        wrong = _one_line(why)
        if wrong:
            return wrong
    if not scored:
        return "refused", "; ".join(failed.values())[:500]
    return ("failed", "; ".join(failed.values())[:500]) if failed else ("scored", "")


def include_case(world, backend) -> tuple[str, str]:
    before = snapshot(world["outside"])
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            outcome, message = include_steps(world, backend)
    except BaseException as e:  # noqa: BLE001 -- the defect the fuzz looks for (SystemExit from task code too)
        if type(e).__name__ == "CaseTimeout":
            raise
        outcome, message = _crash(e)
    if world["marker"].exists() or snapshot(world["outside"]) != before:
        return "outside", f"code or a write reached the outside folder ({outcome}: {message[:200]})"
    return outcome, message


# ---- comparison tables --------------------------------------------------------------------------------------------

TASKS = ("alpha", f"beta{ESC}", "gamma$x$")


def _table_rows(shift: float) -> list[dict]:
    rows = []
    for step in (100, 200, 300, 400, 500):
        for i, task in enumerate(TASKS):
            rows.append({"checkpoint": f"ckpt-{step}", "step": step, "consumed_tokens": step * 4096, "task": task,
                         "metric": "acc", "value": round(0.3 + 0.0005 * step + 0.01 * i + shift, 6),
                         "stderr": 0.01, "error": ""})
    return rows


def _csv(rows: list[dict]) -> str:
    from nano_eval.sweep.table import COLUMNS

    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def build_tables_world(case: Path) -> dict:
    from nano_eval.sweep.table import CSV_NAME

    a, b, victim = case / "a", case / "b", case / "victim"
    for folder in (a, b, victim):
        folder.mkdir(parents=True)
    (a / CSV_NAME).write_text(_csv(_table_rows(0.0)))
    (b / CSV_NAME).write_text(_csv(_table_rows(0.05)))
    (victim / "precious.csv").write_text("mine\n")
    return {"a": a, "b": b, "victim": victim, "table": b / CSV_NAME, "out": case / "cmp", "plots": False}


def tab_flip(world, rng) -> str:
    from tests.surroundings_fuzz2 import flip

    return flip(world["table"], rng)


def tab_truncate(world, rng) -> str:
    from tests.surroundings_fuzz2 import truncate

    return truncate(world["table"], rng)


HOSTILE_CELLS = ["inf", "-inf", "nan", "1e999", "1e300", "-1", "1" + "0" * 300, "", "x", "0x10", "1_000", "  3 ",
                 "t" * 200_000, ESC, "$\\frac{$", "²", "1e-320", "-0.0", "True"]


def tab_cell(world, rng) -> str:
    rows = _table_rows(0.05)
    r = rng.randrange(len(rows))
    column = rng.choice(["checkpoint", "step", "consumed_tokens", "task", "metric", "value", "stderr", "error"])
    rows[r][column] = rng.choice(HOSTILE_CELLS)
    world["table"].write_text(_csv(rows))
    world["plots"] = column in ("task", "metric")
    return f"cell row {r} {column} -> {str(rows[r][column])[:40]!r}"


def tab_rows(world, rng) -> str:
    rows = _table_rows(0.05)
    choice = rng.randrange(4)
    if choice == 0:
        rows += rng.sample(rows, 3)
        what = "duplicated rows"
    elif choice == 1:
        rows = rows[: rng.randrange(len(rows))]
        what = "dropped rows"
    elif choice == 2:
        rng.shuffle(rows)
        what = "shuffled rows"
    else:
        rows = [{**r, "error": "failed: \x1b[2J boom"} if i % 4 == 0 else r for i, r in enumerate(rows)]
        what = "error rows"
    world["table"].write_text(_csv(rows))
    return what


def tab_text(world, rng) -> str:
    text = world["table"].read_text()
    header, rest = text.split("\n", 1)
    choice = rng.randrange(7)
    if choice == 0:
        text = header.replace("stderr", "sd") + "\n" + rest
    elif choice == 1:
        text = header + ",extra\n" + rest
    elif choice == 2:
        text = header + "\n" + rest.replace("\n", ",x,y\n", 1)
    elif choice == 3:
        text = text.replace("\n", "\r\n")
    elif choice == 4:
        text = text.replace(",", "\x00", 1)
    elif choice == 5:
        text = "\ufeff" + text
    else:
        text = header + "\n" + "\n".join(rest.splitlines()[::-1])
    world["table"].write_text(text)
    return f"text edit {choice}"


def tab_special(world, rng) -> str:
    path = world["table"]
    kind = rng.choice(["fifo", "link", "sparse", "folder"])
    if kind == "sparse":
        with path.open("r+b") as fh:
            fh.truncate(8 << 30)
        return "sparse 8 GiB table"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link":
        path.symlink_to(world["victim"] / "precious.csv")
    else:
        path.mkdir()
    return f"{kind} in place of the table"


TABLE_MUTATIONS = [tab_flip, tab_truncate, tab_cell, tab_cell, tab_cell, tab_rows, tab_text, tab_special]


def tables_case(world) -> tuple[str, str]:
    from nano_eval.cli import main
    from nano_eval.sweep import plots

    before = snapshot(world["victim"])
    out, err = io.StringIO(), io.StringIO()
    available = plots.available
    if not world["plots"]:
        plots.available = lambda: False  # plots cost ~0.1 s each; drawn when a case changes names
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(["compare", str(world["a"]), str(world["b"]), "--output-dir", str(world["out"]),
                         "--labels", f"base,run{ESC}"])
    except BaseException as e:  # noqa: BLE001 -- the defect the fuzz looks for
        if type(e).__name__ == "CaseTimeout":
            raise
        return _crash(e)
    finally:
        plots.available = available
    if snapshot(world["victim"]) != before:
        return "outside", "the victim folder changed"
    lines = [line for line in err.getvalue().splitlines() if line.startswith("nano_eval: error")]
    if code == 2:
        if len(lines) == 1 and "Fix:" in lines[0] and "\x1b" not in err.getvalue():
            return "refused", lines[0]
        return "wrong", f"exit 2 with {err.getvalue()[:500]!r}"
    if code != 0:
        return "wrong", f"exit {code}: {err.getvalue()[-500:]!r}"
    if "\x1b" in out.getvalue() + err.getvalue() + (world["out"] / "index.html").read_text():
        return "wrong", "a raw ESC printed or on the page"
    for name in ("compare.csv", "compare_signal.csv"):
        for r in csv.DictReader((world["out"] / name).open()):
            for key, value in r.items():
                if value and key not in ("task", "metric", "run", "baseline", "x", "flagged"):
                    if not math.isfinite(float(value)):
                        return "wrong", f"{name}: {key} = {value}"
    return "compared", ""


# ---- running cases ------------------------------------------------------------------------------------------------

def run(surface: str, work: Path, seed: int, cases: int) -> dict:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    backend = None
    if surface == "include":
        from nano_eval.checkpoints.hf import load_transformers
        from nano_eval.toy import build_toy_checkpoint

        backend = load_transformers(str(build_toy_checkpoint(work / "toy")))
        control = include_case(build_include_world(work / "control"), backend)  # imports all, indexes lm-eval once
        mutations = INCLUDE_MUTATIONS
    else:
        control = tables_case(build_tables_world(work / "control"))
        mutations = TABLE_MUTATIONS
    if surface == "include":
        got, seconds = run_cases(work, seed, cases, build_include_world, mutations,
                                 lambda world: include_case(world, backend), CASE_ALARM_S, CAP_BYTES)
    else:
        got, seconds = run_cases(work, seed, cases, build_tables_world, mutations, tables_case, CASE_ALARM_S,
                                 CAP_BYTES)
    return {"surface": surface, "seed": seed, "control": list(control), "cases": got, "seconds": seconds}


def main(argv=None) -> int:
    return fuzz_main(run, ["include", "tables"], argv)


if __name__ == "__main__":
    raise SystemExit(main())
