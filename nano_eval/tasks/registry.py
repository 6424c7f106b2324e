"""Task registry and task specs.

A spec is `suite|task|num_fewshot` (an old-style 4th field, as in `suite|task|k|0`, is ignored) or, as in current
lighteval, `task|num_fewshot`: the suite is then the one suite that has the task (two suites having it is an error
naming both). Several specs are comma-separated, or listed one per line in a text file (blank lines and # comments
ignored). A spec whose task is the prefix of tasks named `task:...` expands to all of them (`lighteval|mmlu|5`).
Custom tasks live in a Python file defining `TASKS_TABLE: list[TaskConfig]` and optionally `TASKS_GROUPS:
{name: "spec,spec,..."}`, as in lighteval; a group's name is then a spec that stands for its specs.
Specs of the `lm_eval` suite name lm-evaluation-harness's tasks (nano_eval.tasks.lm_eval_tasks).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
from pathlib import Path
from typing import Iterable

from nano_eval.errors import NanoEvalError
from nano_eval.local_files import LocalFileError, entry_kind, read_text
from nano_eval.tasks.config import TaskConfig
from nano_eval.tasks.spec import TaskSpec, TaskSpecError  # noqa: F401  (nano_eval.tasks.registry.TaskSpec)
from nano_eval.tasks.task import Task, load_datasets

SPEC_FORM = "suite|task|num_fewshot or task|num_fewshot, e.g. 'lighteval|arc:easy|25' or 'arc:easy|25'"
TASK_FILE_BYTES = 1 << 20  # a file of task specs (one spec a line: tens of thousands of specs)
LM_EVAL_SUITE = "lm_eval"
LIST_HINT = "see the available tasks with `nano_eval --list-tasks` (or `Registry(...).print_tasks()`)"


def _load_module(path: Path):
    """Import a custom task file by path."""
    if not path.is_file():
        raise NanoEvalError(f"custom task file {path} does not exist; check the --custom-tasks path")
    spec = importlib.util.spec_from_file_location(f"nano_eval_custom_tasks_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise NanoEvalError(f"custom task file {path} failed to import: {type(e).__name__}: {e}") from e
    return module


def _table(module, path: Path) -> list[TaskConfig]:
    table = getattr(module, "TASKS_TABLE", None)
    if table is None:
        raise NanoEvalError(
            f"custom task file {path} defines no TASKS_TABLE; add `TASKS_TABLE = [TaskConfig(...), ...]` "
            f"(TaskConfig from nano_eval.tasks, or LightevalTaskConfig from nano_eval.tasks.lighteval)"
        )
    bad = [c for c in table if not isinstance(c, TaskConfig)]
    if bad:
        raise NanoEvalError(
            f"custom task file {path}: TASKS_TABLE holds {type(bad[0]).__name__} objects; build the entries with "
            f"`from nano_eval.tasks import TaskConfig` (or, for a lighteval file, change its imports to "
            f"`from nano_eval.tasks.lighteval import LightevalTaskConfig, Doc, Metrics`)"
        )
    return list(table)


def _groups(module, path: Path) -> dict[str, str]:
    """TASKS_GROUPS: {group name: comma-separated specs (or a list of specs)}."""
    groups = getattr(module, "TASKS_GROUPS", None) or {}
    if not isinstance(groups, dict):
        raise NanoEvalError(f"custom task file {path}: TASKS_GROUPS is a {type(groups).__name__}; make it a dict "
                            "{group name: 'suite|task|k,suite|task|k'}")
    out = {}
    for name, specs in groups.items():
        if not isinstance(name, str) or "|" in name or "," in name:
            raise NanoEvalError(f"custom task file {path}: TASKS_GROUPS name {name!r} must be a string without "
                                "'|' or ','; rename the group")
        out[name] = specs if isinstance(specs, str) else ",".join(specs)
    return out


def _index(table: list[TaskConfig], origin: str) -> dict[str, TaskConfig]:
    configs: dict[str, TaskConfig] = {}
    for config in table:
        for suite in config.suite:
            full = f"{suite}|{config.name}"
            if full in configs:
                raise NanoEvalError(f"{origin}: task {full!r} is defined twice; rename one of them")
            configs[full] = config
    return configs


class Registry:
    """All known tasks: the built-ins plus, optionally, one custom task file. Built once, never mutated."""

    def __init__(self, custom_tasks: str | os.PathLike | None = None,
                 lm_eval_include_path: str | os.PathLike | None = None):
        from nano_eval.tasks.default_tasks import TASKS_TABLE
        from nano_eval.tasks.demo_tasks import DEMO_TASKS

        configs = _index(TASKS_TABLE + DEMO_TASKS, "nano_eval/tasks/default_tasks.py")
        self._groups: dict[str, str] = {}
        if custom_tasks is not None:
            path = Path(custom_tasks).expanduser()
            module = _load_module(path)
            custom = _index(_table(module, path), f"custom task file {path}")
            self._groups = _groups(module, path)
            clash = sorted(configs.keys() & custom.keys())
            if clash:
                raise NanoEvalError(
                    f"custom task file {path} redefines built-in task(s) {clash}; give them another name or suite"
                )
            configs.update(custom)
        self._configs: dict[str, TaskConfig] = configs
        self._lm_eval_include_path = lm_eval_include_path  # lm-eval's --include_path, for `lm_eval|...` specs
        self._suites = frozenset(full.split("|")[0] for full in configs)

    def list_tasks(self) -> dict[str, list[str]]:
        """{suite: sorted task names}."""
        out: dict[str, list[str]] = {}
        for full in sorted(self._configs):
            suite, task = full.split("|", 1)
            out.setdefault(suite, []).append(task)
        return out

    def supersets(self) -> dict[str, list[str]]:
        """{"suite|prefix": member task names} for every prefix a spec may name to run a family of tasks
        (`lighteval|mmlu` -> every `lighteval|mmlu:<subject>`), except prefixes that are tasks themselves."""
        out: dict[str, list[str]] = {}
        for full in sorted(self._configs):
            parts = full.split(":")
            for n in range(1, len(parts)):
                prefix = ":".join(parts[:n])
                if prefix not in self._configs:
                    out.setdefault(prefix, []).append(full.split("|", 1)[1])
        return out

    def print_tasks(self, suites: Iterable[str] | None = None) -> None:
        """Every task, suite by suite (a task nano_eval cannot run says why), then the supersets of each suite (a spec
        naming one runs all its tasks)."""
        groups = self.supersets()
        for suite, tasks in self.list_tasks().items():
            if suites is not None and suite not in suites:
                continue
            print(f"{suite} ({len(tasks)} tasks)")
            for task in tasks:
                refused = self._configs[f"{suite}|{task}"].unsupported
                note = f"  (cannot run in nano_eval: {refused[0]})" if refused else ""
                print(f"  {suite}|{task}{note}")
            mine = {name: members for name, members in groups.items() if name.split("|", 1)[0] == suite}
            if mine:
                print(f"{suite} supersets (a spec naming one runs all its tasks)")
            for name, members in mine.items():
                shown = ", ".join(members[:3]) + (", ..." if len(members) > 3 else "")
                print(f"  {name}  ({len(members)} task{'s' if len(members) > 1 else ''}: {shown})")

    def get_task_instance(self, name: str | TaskSpec, data_dir: str | os.PathLike | None = None) -> Task:
        full = name.full_name if isinstance(name, TaskSpec) else name
        if full.split("|", 1)[0] == LM_EVAL_SUITE:
            from nano_eval.tasks.lm_eval_tasks import LmEvalTask

            return LmEvalTask(full.split("|", 1)[1], include_path=self._lm_eval_include_path, data_dir=data_dir)
        if full not in self._configs:
            raise self._unknown(full, full)
        return Task(self._configs[full], data_dir=data_dir, suite=full.split("|")[0])

    def get_task_dict(self, names: Iterable[str | TaskSpec], data_dir=None) -> dict[str, Task]:
        """{full name "suite|task": Task}; a task asked for at several shot counts is built once."""
        out: dict[str, Task] = {}
        for name in names:
            full = name.full_name if isinstance(name, TaskSpec) else name
            if full not in out:
                out[full] = self.get_task_instance(full, data_dir)
        return out

    def parse_specs(self, specs: str | os.PathLike | Iterable[str]) -> list[TaskSpec]:
        """Parse, validate and expand specs; duplicates are dropped, order is kept."""
        out: list[TaskSpec] = []
        for raw in self._ungroup(_spec_strings(specs), ()):
            for spec in self._lm_eval_specs(raw) if raw.split("|", 1)[0].strip() == LM_EVAL_SUITE \
                    else self._expand(self._parse_one(raw), raw):
                if spec not in out:
                    out.append(spec)
        if not out:  # an empty or truncated tasks file: scoring nothing and exiting 0 would hide it
            shown = str(specs) if isinstance(specs, (str, os.PathLike)) else list(specs)
            raise TaskSpecError(f"no task specs in {shown!r}; expected {SPEC_FORM} (a tasks file holds one per line)")
        return out

    def _lm_eval_specs(self, raw: str) -> list[TaskSpec]:
        from nano_eval.tasks.lm_eval_tasks import parse_spec

        return parse_spec(raw, self._lm_eval_include_path)

    def _ungroup(self, raws: list[str], inside: tuple[str, ...]) -> list[str]:
        """Replace TASKS_GROUPS names by their specs (groups may name groups; a cycle is an error)."""
        out = []
        for raw in raws:
            if raw not in self._groups:
                out.append(raw)
            elif raw in inside:
                raise TaskSpecError(f"TASKS_GROUPS {raw!r} contains itself (via {' -> '.join(inside)}); fix the group")
            else:
                out += self._ungroup(_spec_strings(self._groups[raw]), (*inside, raw))
        return out

    def _parse_one(self, raw: str) -> TaskSpec:
        """`suite|task|k[|x]`, or `task|k` whose suite is the one suite that has `task` (or tasks `task:...`)."""
        fields = [f.strip() for f in raw.split("|")]
        if len(fields) == 2 and fields[0] and _is_count(fields[1]):
            task = fields[0]
            suites = sorted({full.split("|")[0] for full in self._configs
                             if full.split("|", 1)[1] == task or full.split("|", 1)[1].startswith(task + ":")})
            if len(suites) > 1:
                raise TaskSpecError(f"task spec {raw!r} names no suite and suites {suites} all have {task!r}; write "
                                    f"it as {' or '.join(f'{s}|{raw}' for s in suites)}")
            if not suites:
                raise self._unknown(task, raw)
            fields = [suites[0], *fields]
        return _parse_one(fields, raw, self._suites)

    def _expand(self, spec: TaskSpec, raw: str) -> list[TaskSpec]:
        if spec.full_name in self._configs:
            return [spec]
        prefix = spec.full_name + ":"
        members = [full for full in self._configs if full.startswith(prefix)]
        if not members:
            raise self._unknown(spec.full_name, raw)
        return [TaskSpec(suite=spec.suite, task=full.split("|", 1)[1], num_fewshot=spec.num_fewshot)
                for full in sorted(members)]

    def _unknown(self, full: str, raw: str) -> TaskSpecError:
        close = difflib.get_close_matches(full, list(self._configs), n=5, cutoff=0.6)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        return TaskSpecError(f"unknown task {full!r} in spec {raw!r}; {hint}{LIST_HINT}")


def _is_count(text: str) -> bool:
    """A few-shot count: at most 6 ASCII digits (`str.isdigit` is also true of '²', which `int` refuses, and of
    '٣' and other Unicode digits, which `int` reads as numbers nobody typed)."""
    return text.isascii() and text.isdigit() and len(text) <= 6


def _spec_strings(specs: str | os.PathLike | Iterable[str]) -> list[str]:
    """Split comma-separated specs; a path to an existing file is read as one spec per line (a regular UTF-8 file
    of at most TEXT_BYTES: a FIFO, a device or a binary file is refused in one line)."""
    if isinstance(specs, (str, os.PathLike)):
        text = str(specs)
        path = Path(text).expanduser()
        if "|" not in text and entry_kind(path) not in (None, "folder"):
            try:
                content = read_text(os.path.realpath(path), TASK_FILE_BYTES)
            except LocalFileError as e:
                raise TaskSpecError(f"task file {e}") from None
            lines = content.splitlines()
            return [s for line in lines for s in _spec_strings(line.split("#", 1)[0])]
        return [s.strip() for s in text.split(",") if s.strip()]
    return [s for item in specs for s in _spec_strings(item)]


def _parse_one(fields: list[str], raw: str, suites: frozenset[str]) -> TaskSpec:
    if len(fields) not in (3, 4) or not all(fields[:3]):
        raise TaskSpecError(f"malformed task spec {raw!r}: expected {SPEC_FORM}")
    suite, task, shots = fields[:3]
    if not _is_count(shots):
        raise TaskSpecError(
            f"malformed task spec {raw!r}: num_fewshot {shots!r} is not a non-negative integer (at most 6 ASCII "
            f"digits); expected {SPEC_FORM}"
        )
    if suite not in suites:
        raise TaskSpecError(f"unknown suite {suite!r} in task spec {raw!r}: known suites are {sorted(suites)}")
    return TaskSpec(suite=suite, task=task, num_fewshot=int(shots))


def load_tasks(specs: str | os.PathLike | Iterable[str], *, custom_tasks: str | os.PathLike | None = None,
               data_dir: str | os.PathLike | None = None,
               bad_documents: dict[str, str] | None = None,
               lm_eval_include_path: str | os.PathLike | None = None) -> list[tuple[TaskSpec, Task]]:
    """Parse `specs`, build their tasks and load every task's evaluation documents (several tasks at a time):
    [(TaskSpec, Task)] in spec order. Bad specs, missing data and unscorable documents fail here, before any model
    is touched; with a `bad_documents` dict, tasks with unscorable documents are left out and recorded there
    ({"suite|task": message}) instead. `lm_eval_include_path`: a folder of the user's own lm-eval task YAMLs, for
    `lm_eval|...` specs (lm-eval's --include_path)."""
    registry = Registry(custom_tasks=custom_tasks, lm_eval_include_path=lm_eval_include_path)
    parsed = registry.parse_specs(specs)
    tasks = registry.get_task_dict(parsed, data_dir=data_dir)
    loaded = load_datasets(tasks, processes=min(8, len(tasks)), bad_documents=bad_documents)
    return [(spec, tasks[spec.full_name]) for spec in parsed if spec.full_name in loaded]
