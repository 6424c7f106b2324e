"""An `--lm-eval-include-path` folder is a root (nano_eval.local_files' rule), and lm-eval reads it only through
what nano_eval vetted.

lm-eval 0.4.13's TaskManager walks every include folder (`**/*.yaml`) and opens each file it finds (a FIFO blocks it
forever), parses them with libyaml (no bound on aliases or nodes; 100,000 `[` crash the process), and resolves
`include:` and `!function` wherever they lead (an absolute path, `../..`, a FIFO, any installed module). Before
lm-eval sees the folder, `IncludeRoot.scan` reads it by nano_eval's rule:

- The folder is walked without following symlinked folders (as lm-eval's own walk on Python 3.11). Every `*.yaml`
  file, every file an `include:` names and every Python file a `!function` names is read as a regular file (a FIFO,
  socket or device is refused by name, never opened) lying inside the folder once every symlink is resolved (a link
  that leads out is refused; one to a file inside is followed), of at most TASK_FILE_BYTES, as UTF-8.
- Every YAML file's structure is bounded before any parser builds it (local_files.compose_yaml): at most YAML_NODES
  nodes once its aliases are expanded, at most YAML_DEPTH levels deep, no alias that contains itself.
- Task, group and tag names are printable (lm-eval prints them as they are: a name holding a terminal escape or
  a newline and a forged `nano_eval: error:` line is refused; nano_eval escapes every other name it prints).
- `include:` must name a file inside the folder, or a YAML of lm-eval's own catalogue (`include:
  .../lm_eval/tasks/arc/arc_easy.yaml`, read by lm-eval as it reads its own tasks). `!function` must name a Python file inside the folder (`utils.fn`:
  `utils.py` next to the YAML, as lm-eval resolves it), or a function of lm-eval's own catalogue
  (`lm_eval.tasks.<...>`: code lm-eval ships, which nano_eval runs for lm-eval's own tasks too). Anything else (an
  absolute path or `..` leading out, an installed module such as `os.system`) is refused, naming the YAML.
- At most INCLUDE_ENTRIES entries are walked and INCLUDE_FILES files read, INCLUDE_BYTES in all.

A file that is no task config (a YAML syntax error, text that is not UTF-8) is left out, as lm-eval skips it; the
reason is kept (`skipped`) for the error that names an unknown task. Every refusal is a LocalFileError (one line:
the file, what is wrong, the fix; exit code 2), raised when the folder is first used, before any model loads.

`vetted_loading(roots)` wraps lm-eval's indexing and loading (its `TaskIndex._iter_yaml_files` and `load_yaml`):
the files of these folders come from the snapshot the scan took, so lm-eval never opens a file there itself and a
file swapped after the scan is never read. YAMLs are parsed by libyaml only after the bounds above held, with
lm-eval's own `!function` semantics (a path string while indexing, the function when a task loads).

What runs code: the Python files of the folder that a loading task names with `!function`, and nothing else. They
are the user's code, as `--custom-tasks` files are: they run, with the process's powers, when a task naming them
loads (never while the folder is indexed), compiled from the source the scan read (`user_module`; tracebacks show
that source, never reopening the file). Jinja in the YAMLs renders in a sandbox (nano_eval.tasks.lm_eval_tasks).

The snapshot is taken once per process and include path, when its TaskManager is built (nano_eval.tasks.
lm_eval_tasks), as lm-eval's index is: edits made later are seen by the next process (a sweep fingerprints the folder
when its tasks load, so it never reuses results scored with older files). lm-eval's own catalogue (~14,000 YAMLs,
installed with it) is indexed once per process and reused by every TaskManager (`_catalogue_index`): only an include
folder is indexed again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import linecache
import logging
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from nano_eval.local_files import (
    LocalFileError,
    YamlShapeError,
    compose_yaml,
    printable,
    read_bytes,
    resolve_inside,
    yaml_children,
)

TASK_FILE_BYTES = 4 << 20  # one YAML or Python file (lm-eval's largest: a 62 KB YAML, an 89 KB utils.py)
INCLUDE_FILES = 20_000  # files read from one folder (lm-eval's whole catalogue, copied: ~14,000 YAMLs)
INCLUDE_BYTES = 256 << 20  # bytes read from one folder, all files together
INCLUDE_ENTRIES = 200_000  # files and folders walked in one folder
YAML_NODES = 200_000  # nodes of one task YAML once its aliases are expanded (lm-eval's largest: ~6,000)
YAML_DEPTH = 64  # nesting of one task YAML (lm-eval's: under 10)
IGNORED_DIRS = ("__pycache__", ".ipynb_checkpoints")  # lm-eval's index skips these folders
CATALOGUE_MODULES = "lm_eval.tasks."  # `!function` may name functions of lm-eval's own catalogue
FIX_FOLDER = "remove it from the --lm-eval-include-path folder, or replace it by the regular file it stands for"
FIX_REFERENCE = ("keep every file a task YAML includes or names with `!function` inside the --lm-eval-include-path "
                 "folder (`!function utils.fn` reads utils.py next to the YAML)")

log = logging.getLogger("lm_eval.tasks._index")


@dataclass
class IncludeRoot:
    """The vetted snapshot of one include folder (build it with `scan`).

    root: the folder's real path. listed: the `*.yaml` files lm-eval indexes, in its order; real_of: listed path ->
    its real path. yamls: real path -> text, of every YAML read (task files and what they include). includes:
    (real YAML, include value) -> real path of the included file. functions: (real folder of the YAML, `!function`
    value) -> the real Python file, or None for a function of lm-eval's catalogue. python: real path -> source.
    skipped: files left out (as lm-eval leaves them out) -> why."""

    root: Path
    listed: list[Path] = field(default_factory=list)
    real_of: dict[Path, Path] = field(default_factory=dict)
    yamls: dict[Path, str] = field(default_factory=dict)
    includes: dict[tuple[Path, str], Path] = field(default_factory=dict)
    functions: dict[tuple[Path, str], Path | None] = field(default_factory=dict)
    python: dict[Path, str] = field(default_factory=dict)
    skipped: dict[Path, str] = field(default_factory=dict)
    bytes_read: int = 0

    # -- reading the folder --

    @classmethod
    def scan(cls, folder: str | os.PathLike) -> IncludeRoot:
        """Walk and read `folder` by the rule of this module; LocalFileError on the first thing refused."""
        given = Path(folder).expanduser()
        if not given.is_dir():
            raise LocalFileError(folder, "is not a folder", "name the folder holding your lm-eval task YAMLs "
                                 "(--lm-eval-include-path)")
        view = cls(root=Path(os.path.realpath(given)))
        entries = 0
        for here, dirs, files in os.walk(view.root, followlinks=False):
            entries += len(dirs) + len(files)
            if entries > INCLUDE_ENTRIES:
                raise LocalFileError(view.root, f"holds more than {INCLUDE_ENTRIES:,} files and folders",
                                     "point --lm-eval-include-path at the folder of your task YAMLs")
            dirs[:] = sorted(d for d in dirs if d not in IGNORED_DIRS and not os.path.islink(os.path.join(here, d)))
            for name in sorted(files):
                if name.endswith(".yaml"):
                    view._task_file(Path(here) / name)
        view.listed.sort(key=lambda p: p.as_posix())  # lm-eval's order
        return view

    def _task_file(self, path: Path) -> None:
        real = self._inside(path, path, FIX_FOLDER)
        if real is None or os.path.isdir(real):  # a link to nothing, or to a folder: lm-eval skips it too
            self.skipped[path] = "a link to nothing" if real is None else "a folder"
            return
        self.listed.append(path)
        self.real_of[path] = real
        self._read_yamls(real, named_by=path)

    def _inside(self, path: Path, named_by: Path, fix: str) -> Path | None:
        """The real path of `path` (inside the root, or LocalFileError naming `named_by`); None if nothing is
        there."""
        if "\0" in str(path):
            raise LocalFileError(named_by, f"names {printable(str(path))}, a path with a NUL character", fix)
        try:
            real = resolve_inside(path, self.root, fix)
        except LocalFileError as e:
            subject = named_by if named_by != path else path
            what = e.what if subject == path else f"names {printable(str(path))}, which {e.what}"
            raise LocalFileError(subject, what, fix) from None
        return real if os.path.lexists(real) else None

    def _read(self, real: Path, named_by: Path) -> str | None:
        """The text of the regular file `real` (None, noted in `skipped`, when it is not UTF-8)."""
        if len(self.yamls) + len(self.python) >= INCLUDE_FILES:
            raise LocalFileError(self.root, f"holds more than {INCLUDE_FILES:,} task files",
                                 "point --lm-eval-include-path at the folder of your task YAMLs")
        try:
            data = read_bytes(real, TASK_FILE_BYTES, root=self.root)
        except FileNotFoundError:
            raise LocalFileError(named_by, "disappeared while nano_eval read the include folder",
                                 "run again once the folder is complete") from None
        except LocalFileError as e:
            big = "bytes" in e.what and not e.what.startswith("is a")
            what = f"is more than {TASK_FILE_BYTES >> 20} MiB, more than any task file" if big else e.what
            fix = f"keep task files under {TASK_FILE_BYTES >> 20} MiB" if big else FIX_FOLDER
            if named_by == real:
                raise LocalFileError(real, what, fix) from None
            raise LocalFileError(named_by, f"names {printable(str(real))}, which {what}", fix) from None
        self.bytes_read += len(data)
        if self.bytes_read > INCLUDE_BYTES:
            raise LocalFileError(self.root, f"holds more than {INCLUDE_BYTES >> 20} MiB of task files",
                                 "point --lm-eval-include-path at the folder of your task YAMLs")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            self.skipped[real] = f"not UTF-8 text ({e.reason} at byte {e.start})"
            return None

    def _read_yamls(self, first: Path, named_by: Path) -> None:
        """Read `first` and every file it includes, transitively (a worklist: no recursion)."""
        import yaml

        todo = [(first, named_by)]
        while todo:
            real, by = todo.pop()
            if real in self.yamls or real in self.skipped:
                continue
            text = self._read(real, by)
            if text is None:
                continue
            try:
                node = compose_yaml(text, max_nodes=YAML_NODES, max_depth=YAML_DEPTH)
            except YamlShapeError as e:
                raise LocalFileError(real, f"{e} (a task config never does)", "fix or remove the file") from None
            except yaml.YAMLError as e:  # no task config: lm-eval skips it
                self.skipped[real] = f"not valid YAML ({' '.join(str(e).split())[:200]})"
                continue
            self.yamls[real] = text
            for name in _names(node):
                if not name.isprintable():
                    raise LocalFileError(real, f"names a task, group or tag '{printable(name)}' with control "
                                         "characters (lm-eval prints names to the terminal as they are)",
                                         "use a name of printable characters")
            for value in _include_values(node):
                target = real.parent / value
                if "\0" not in value and in_catalogue(target) and os.path.isfile(target):
                    self.includes[(real, value)] = Path(os.path.realpath(target))  # lm-eval's own: lm-eval reads it
                    continue
                inside = self._inside(target, real, FIX_REFERENCE)
                if inside is None:
                    continue  # lm-eval fails on a missing include, skipping the task: left to it
                self.includes[(real, value)] = inside
                todo.append((inside, real))
            for spec in _function_values(node):
                self._function(real, spec)

    def _function(self, yaml_path: Path, spec: str) -> None:
        """Vet the `!function spec` of the YAML `yaml_path`, resolved as lm-eval resolves it: the Python file
        `<folder of the YAML>/<module with dots as slashes>.py` if there is one, else an importable module."""
        folder = yaml_path.parent
        module, _, _ = spec.rpartition(".")
        if (folder, spec) in self.functions or not module:
            return  # lm-eval refuses a reference without a module itself, when the task loads
        candidate = folder / f"{module.replace('.', '/')}.py"
        if os.path.lexists(candidate):
            real = self._inside(candidate, yaml_path, FIX_REFERENCE)
            if real is None:
                raise LocalFileError(yaml_path, f"`!function {printable(spec)}` names {printable(str(candidate))},"
                                     " which is a link to nothing", FIX_REFERENCE)
            if real not in self.python:
                source = self._read(real, yaml_path)
                if source is None:
                    raise LocalFileError(real, self.skipped.pop(real), "save the Python file as UTF-8")
                self.python[real] = source
            self.functions[(folder, spec)] = real
        elif module.startswith(CATALOGUE_MODULES):
            self.functions[(folder, spec)] = None
        else:
            raise LocalFileError(yaml_path, f"`!function {printable(spec)}` names no Python file of the include "
                                 f"folder ({printable(str(candidate))} does not exist) but a module nano_eval will "
                                 "not import for a task", FIX_REFERENCE)

    # -- what lm-eval reads --

    def load(self, real: Path, resolve_func: bool, recursive: bool, seen: set[Path], lm_eval_load) -> dict:
        """lm-eval's `load_yaml` on the vetted texts: the YAML `real` as a dict, its `include:`s merged under it
        (the including file's keys win, an included `task_list` is dropped, a file met twice is an include cycle:
        lm-eval's rules), `!function` values as lm-eval gives them (a path string while indexing, the function
        when `resolve_func`). An included file of lm-eval's own catalogue is read by `lm_eval_load` (lm-eval's
        loader)."""
        import yaml

        if real in seen:
            raise ValueError(f"Include cycle at {real}")
        seen.add(real)
        if real not in self.yamls:
            raise FileNotFoundError(f"{real}: {self.skipped.get(real, 'not a task file of the include folder')}")
        config = yaml.load(self.yamls[real], Loader=self._loader(real.parent, resolve_func))  # noqa: S506 (bounded)
        if not isinstance(config, dict):
            raise ValueError(f"Expected YAML dict from {real}, got {type(config).__name__}")
        if not recursive or "include" not in config:
            return config
        includes = config.pop("include")
        merged: dict = {}
        for value in includes if isinstance(includes, list) else [includes]:
            target = self.includes.get((real, value)) if isinstance(value, str) else None
            if target is None:
                raise FileNotFoundError(f"{real}: include {value!r} names no file of the include folder")
            if target not in self.yamls and in_catalogue(target):
                included = lm_eval_load(target, resolve_func=resolve_func, recursive=True, _seen=seen)
            else:
                included = self.load(target, resolve_func, True, seen, lm_eval_load)
            included.pop("task_list", None)
            merged.update(included)
        merged.update(config)
        return merged

    def _loader(self, folder: Path, resolve_func: bool):
        import yaml

        class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
            pass

        def function(loader, node):
            spec = loader.construct_scalar(node)
            return self.function(folder, spec) if resolve_func else str(folder / spec)

        Loader.add_constructor("!function", function)
        return Loader

    def function(self, folder: Path, spec: str) -> Any:
        """The object `!function spec` names from a YAML in `folder` (vetted by the scan): a function or class of
        a Python file of the folder (imported from the vetted source), or of lm-eval's catalogue."""
        module_name, _, name = spec.rpartition(".")
        if not module_name:
            raise ValueError(f"Invalid function reference '{spec}': no module path (from YAML in {folder})")
        if (folder, spec) not in self.functions:
            raise ImportError(f"`!function {spec}` (from YAML in {folder}) was not vetted")
        path = self.functions[(folder, spec)]
        module = importlib.import_module(module_name) if path is None else user_module(path, self.python[path])
        obj = getattr(module, name, None)
        if obj is None:
            raise AttributeError(f"Module '{path or module_name}' has no function '{name}' (from YAML in {folder})")
        if path is None and not str(getattr(obj, "__module__", "")).startswith(CATALOGUE_MODULES):
            raise ImportError(f"`!function {spec}` names {name}, which lm-eval's catalogue does not define")
        return obj


@functools.lru_cache(maxsize=1)
def catalogue_dir() -> str:
    """The real path of lm-eval's own task folder (its installed catalogue)."""
    import lm_eval

    return os.path.realpath(Path(lm_eval.__file__).parent / "tasks")


def in_catalogue(path: str | Path) -> bool:
    """`path`, once its links are resolved, lies in lm-eval's own task folder."""
    real, folder = os.path.realpath(path), catalogue_dir()
    return real == folder or real.startswith(folder + os.sep)


def _include_values(node) -> list[str]:
    """The `include:` values of a composed top-level mapping (lm-eval reads includes there only)."""
    import yaml

    if not isinstance(node, yaml.MappingNode):
        return []
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.value == "include":
            items = value.value if isinstance(value, yaml.SequenceNode) else [value]
            return [item.value for item in items if isinstance(item, yaml.ScalarNode) and item.value]
    return []


def _names(node) -> list[str]:
    """The `task:`, `group:` and `tag:` names of a composed top-level mapping (scalars, or lists of scalars)."""
    import yaml

    if not isinstance(node, yaml.MappingNode):
        return []
    out = []
    for key, value in node.value:
        if isinstance(key, yaml.ScalarNode) and key.value in ("task", "group", "tag"):
            items = value.value if isinstance(value, yaml.SequenceNode) else [value]
            out += [item.value for item in items if isinstance(item, yaml.ScalarNode)]
    return out


def _function_values(root) -> list[str]:
    """Every `!function` value anywhere in the composed document (shared nodes visited once)."""
    import yaml

    out, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode) and node.tag == "!function":
            out.append(node.value)
        stack.extend(yaml_children(node))
    return out


# ---- the user's Python ------------------------------------------------------------------------------------------

_USER_MODULES: dict[Path, tuple[str, types.ModuleType]] = {}


def user_module(path: Path, source: str) -> types.ModuleType:
    """The module of the include folder's Python file `path`, run from `source` (what the scan read) once per
    process and source, named as lm-eval names it (its path without `.py`) and registered in sys.modules; its
    source is put in linecache, so a traceback through it never reopens the file."""
    cached = _USER_MODULES.get(path)
    if cached is not None and cached[0] == source:
        return cached[1]
    name = str(path.with_suffix(""))
    module = types.ModuleType(name)
    module.__file__ = str(path)
    code = compile(source, str(path), "exec")
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)  # noqa: S102 -- the user's own task code, as lm-eval would import it
    except BaseException:
        sys.modules.pop(name, None)
        raise
    _USER_MODULES[path] = (source, module)
    return module


def vetted_source(filename: str) -> str | None:
    """The source a module of an include folder was run from (None for any other file)."""
    cached = _USER_MODULES.get(Path(filename))
    return cached[0] if cached is not None else None


# ---- lm-eval's indexing and loading, through the snapshots ------------------------------------------------------

_CATALOGUE: dict[bool, dict] = {}


def _catalogue_index(original_build, root: Path, resolve_includes: bool) -> dict:
    """lm-eval's index of its own task folder, built once per process; each caller gets its own copy (entries and
    their tag sets copied: a TaskManager adds names to its index)."""
    if resolve_includes not in _CATALOGUE:
        _CATALOGUE[resolve_includes] = original_build([root], resolve_includes=resolve_includes)
    return {name: dataclasses.replace(entry, tags=set(entry.tags))
            for name, entry in _CATALOGUE[resolve_includes].items()}


@contextlib.contextmanager
def vetted_loading(roots: Sequence[IncludeRoot]) -> Iterator[None]:
    """While the block runs (lm-eval's TaskManager built, or tasks loaded; callers hold their module lock), lm-eval
    lists and reads the files of `roots` from their snapshots; a path below a root that the scan did not read is
    refused; files elsewhere (lm-eval's catalogue) are read by lm-eval as usual."""
    from lm_eval.tasks import _factory, _index, manager

    index_cls = _index.TaskIndex
    original_load, original_iter, original_build = _index.load_yaml, index_cls._iter_yaml_files, index_cls.build
    by_root = {view.root: view for view in roots}
    own = Path(catalogue_dir())

    def find(path) -> tuple[IncludeRoot | None, Path | None]:
        path = Path(path)
        for view in roots:
            if path in view.real_of:
                return view, view.real_of[path]
            if path in view.yamls:
                return view, path
        absolute = Path(os.path.abspath(os.path.expanduser(path)))
        for view in roots:
            if absolute == view.root or view.root in absolute.parents:
                return view, None
        return None, None

    def load_yaml(path, *, resolve_func=True, recursive=True, _seen=None):
        view, real = find(path)
        if view is None:
            return original_load(path, resolve_func=resolve_func, recursive=recursive, _seen=_seen)
        if real is None:
            raise LocalFileError(path, "was not in the include folder when nano_eval read it", "run again")
        return view.load(real, resolve_func, recursive, set(), original_load)

    def iter_yaml_files(root):
        view = by_root.get(Path(os.path.realpath(root)))
        return iter(view.listed) if view is not None else original_iter(root)

    def build(paths, *, resolve_includes=True):
        index: dict = {}
        for root in paths:
            part = (_catalogue_index(original_build, own, resolve_includes) if Path(root).resolve() == own
                    else original_build([root], resolve_includes=resolve_includes))
            for name, entry in part.items():
                if name in index:
                    log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                                index[name].yaml_path)
                index[name] = entry
        return index

    _index.load_yaml = _factory.load_yaml = manager.load_yaml = load_yaml
    index_cls._iter_yaml_files, index_cls.build = staticmethod(iter_yaml_files), staticmethod(build)
    try:
        yield
    finally:
        _index.load_yaml = _factory.load_yaml = manager.load_yaml = original_load
        index_cls._iter_yaml_files, index_cls.build = staticmethod(original_iter), staticmethod(original_build)
