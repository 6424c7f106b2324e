"""Which lm-eval tasks call a remote API or service while they run, found before any model loads.

lm-eval tasks are YAML plus Python: `!function` hooks (prompt functions, `process_docs`, `process_results`,
metrics, aggregations, custom filters) and Task subclasses (`class: !function ...`). A few of them call out: lm-eval
0.4.13's `realtoxicityprompts` posts every generation to Google's Perspective API, its `pisa_*_llm_judged` tasks ask
OpenAI's API to grade the answers. Such a task needs network access and credentials that a training job on a
cluster node rarely has, sends the model's outputs elsewhere, and gives scores that depend on a remote model nobody
pins; nano_eval (nano_eval.tasks.lm_eval_tasks.unsupported_reasons) refuses it by name at start-up instead of
failing, hanging on a timeout or silently calling out at every evaluation.

`remote_calls(task)` reads the task's own Python, never runs it: every code object reachable from the task's hooks
and from the methods of its Task subclass, following the names they use into other functions and classes of task
code (files under lm-eval's tasks/ folder, or outside the installed libraries: the user's include path). A hook
calls out when it imports or names a module of a web-API client, of HTTP, TLS or sockets (REMOTE_MODULES), or one of
lm-eval's model wrappers (`lm_eval.models`: a second model as a judge), also through `__import__('socket')`,
`importlib.import_module('urllib.request')` and the like with the name written out; a hook that imports a module by a
name computed at run time (`importlib.import_module(name)`) is refused too, since what it imports cannot be read.
Libraries are not read into (sacrebleu, sklearn, evaluate): a task is not refused for what a library it uses could
do, nor for the optional dependencies lm-eval lists. The dataset loader (`custom_dataset`) is not looked at either:
it has already run when the task loaded, as lm-eval's Hub downloads have, and fetching data is not scoring. Over
lm-eval 0.4.13's catalogue it finds exactly realtoxicityprompts and the six pisa_*_llm_judged tasks.

This is a check of what a task says, not a sandbox: it cannot see code that hides what it does, which runs with the
process's powers like any Python you run (README, "What is safe to load"): strings run by `eval` / `exec`, names
looked up at run time (`getattr(module, name)`, `sys.modules[...]`, `globals()[...]`), a library (or a program
started with `subprocess` / `os.system`) that reaches the network on the task's behalf, native code (`ctypes`).
The Python of an include path is the user's own code, as `--custom-tasks` files are.
"""

from __future__ import annotations

import ast
import dis
import functools
import os
import sys
import sysconfig
import types
from dataclasses import fields, is_dataclass
from typing import Any

from nano_eval.tasks.lm_eval_files import catalogue_dir, vetted_source

# Modules whose use means a request leaves the machine: web-API clients, HTTP and socket libraries, and lm-eval's
# model wrappers (its API models, or any second model used as a judge). A name matches itself and its submodules.
REMOTE_MODULES = (
    "openai", "anthropic", "cohere", "mistralai", "together", "litellm", "groq", "google.generativeai",
    "google.genai", "vertexai", "googleapiclient", "boto3", "botocore", "requests", "httpx", "aiohttp", "urllib3",
    "urllib.request", "http.client", "http.server", "xmlrpc", "ftplib", "smtplib", "poplib", "imaplib", "nntplib",
    "telnetlib", "socket", "socketserver", "ssl", "websocket", "websockets", "grpc", "pycurl",
    "paramiko", "lm_eval.models",
)
# Calls that import the module named by their first argument: a constant is checked as an import; anything else
# (a name computed at run time) cannot be read and is a finding
DYNAMIC_IMPORTS = ("__import__", "import_module", "importlib.import_module", "importlib.__import__",
                   "builtins.__import__")
# What ran when the task loaded (its data: the config's dataset hook, a Task subclass's `download`), not while it
# builds or scores
NOT_READ = ("custom_dataset", "download")
MAX_CODE_OBJECTS = 5000  # a bound on how much task code one task's check reads


def remote_module(name: str) -> str | None:
    """The entry of REMOTE_MODULES that the dotted module `name` is or lies under, else None."""
    for remote in REMOTE_MODULES:
        if name == remote or name.startswith(remote + "."):
            return remote
    return None


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """Folders of installed libraries and the standard library (their code is not task code)."""
    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p))
    return tuple(sorted(os.path.realpath(d) for d in dirs if d))


def is_task_code(filename: str) -> bool:
    """Code in `filename` belongs to a task (lm-eval's tasks/ folder, or any file outside the installed libraries
    and the standard library: the user's include path), not to a library."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    if _under(path, catalogue_dir()):
        return True
    return not any(_under(path, d) for d in _library_dirs())


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=256)
def _module_imports(filename: str) -> dict[str, str]:
    """{name bound at module level: the module it names} from the source of `filename` (imports inside `try` /
    `if` blocks included: `try: from openai import OpenAI` binds OpenAI even where openai is not installed).
    `import a.b` binds `a` to "a.b" (what the file asked for); `from a import b` binds `b` to "a.b"."""
    try:
        tree = ast.parse(_source(filename))
    except (OSError, SyntaxError, ValueError):
        return {}
    bound: dict[str, str] = {}

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    visit([s for s in getattr(node, block, []) if isinstance(s, ast.stmt)]
                          + [s for h in getattr(node, block, []) if isinstance(h, ast.ExceptHandler)
                             for s in h.body])

    visit(tree.body)
    return bound


def _source(filename: str) -> str:
    """The source a task module was run from: what nano_eval vetted for an include folder's file, else the file read
    by local_files' rule (a regular file, never blocked on; a FIFO or a file past 16 MiB reads as nothing)."""
    from nano_eval.local_files import LocalFileError, read_bytes

    source = vetted_source(filename)
    if source is not None:
        return source
    try:
        return read_bytes(filename, 16 << 20).decode("utf-8", errors="replace")
    except LocalFileError as e:
        raise OSError(str(e)) from None


@functools.lru_cache(maxsize=256)
def _dynamic_imports(filename: str) -> dict[int, list[str | None]]:
    """{line: [module named, or None when computed at run time]} of the calls of `__import__`,
    `importlib.import_module` and the like (DYNAMIC_IMPORTS) in the source of `filename`."""
    try:
        tree = ast.parse(_source(filename))
    except (OSError, SyntaxError, ValueError):
        return {}
    found: dict[int, list[str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _dotted(node.func) in DYNAMIC_IMPORTS:
            first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
            named = first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None
            found.setdefault(node.lineno, []).append(named)
    return found


def _dotted(node: ast.expr) -> str:
    """`a.b.c` for a Name / Attribute chain, "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


class _Reader:
    """Walks task code from its hooks; `found` is the first (path, remote module) met."""

    def __init__(self):
        self.seen: set[Any] = set()
        self.found: tuple[list[str], str] | None = None

    def callable(self, obj: Any, path: list[str]) -> None:
        """A hook or a name a hook uses: a function, method, partial or class of task code is read; a module,
        class or function of a remote module is a finding."""
        if self.found is not None or len(self.seen) > MAX_CODE_OBJECTS:
            return
        obj = getattr(obj, "__func__", obj)  # bound methods, classmethod / staticmethod
        if isinstance(obj, functools.partial):
            self.callable(obj.func, path)
            return
        if isinstance(obj, types.ModuleType):
            self._module(obj.__name__, path)
            return
        if isinstance(obj, type):
            self._class(obj, path)
            return
        code = getattr(obj, "__code__", None)
        if isinstance(code, types.CodeType):
            if is_task_code(code.co_filename):
                self._code(code, getattr(obj, "__globals__", {}), path + [obj.__qualname__])
            else:
                self._module(getattr(obj, "__module__", None) or "", path + [obj.__qualname__])
            return
        if isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            self._module(getattr(obj, "__module__", None) or "", path)
            return
        self._class(type(obj), path)  # any other object: a client made at import, a callable metric object

    def _module(self, name: str, path: list[str]) -> None:
        remote = remote_module(name)
        if remote is not None and self.found is None:
            self.found = (path, remote)

    def _class(self, cls: type, path: list[str]) -> None:
        if cls in self.seen:
            return
        self.seen.add(cls)
        self._module(cls.__module__ or "", path + [cls.__qualname__])
        for klass in cls.__mro__:
            module = sys.modules.get(klass.__module__)
            filename = getattr(module, "__file__", None) or ""
            if not is_task_code(filename):
                continue
            for name, member in vars(klass).items():
                if name in NOT_READ:
                    continue
                if isinstance(member, property):
                    member = member.fget
                if isinstance(member, (types.FunctionType, classmethod, staticmethod)):
                    self.callable(member, path + [klass.__qualname__] if klass is not cls else path)

    def _code(self, code: types.CodeType, globals_: dict, path: list[str]) -> None:
        if code in self.seen or self.found is not None:
            return
        self.seen.add(code)
        imports = _module_imports(code.co_filename)
        self._dynamic(code, path)
        importing = chain = None  # chain: the module a `name.attr.attr` being loaded names so far
        for ins in dis.get_instructions(code):
            if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain:
                chain = f"{chain}.{ins.argval}"  # `import urllib` ... `urllib.request.urlopen`
                self._module(chain, path)
                continue
            chain = None
            if ins.opname == "IMPORT_NAME":
                importing = str(ins.argval)
                self._module(importing, path)
            elif ins.opname == "IMPORT_FROM" and importing:
                self._module(f"{importing}.{ins.argval}", path)
            elif ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
                name = str(ins.argval)
                if name in imports:
                    self._module(imports[name], path)
                    chain = imports[name]
                if name in globals_:
                    self.callable(globals_[name], path)
                    if isinstance(globals_[name], types.ModuleType):
                        chain = globals_[name].__name__
            if self.found is not None:
                return
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                self._code(const, globals_, path)

    def _dynamic(self, code: types.CodeType, path: list[str]) -> None:
        """`__import__('socket')`, `importlib.import_module(name)`, ... on the lines of `code`."""
        calls = _dynamic_imports(code.co_filename)
        for line in sorted(_lines(code) & set(calls)) if calls else ():
            for named in calls[line]:
                if named is None and self.found is None:
                    self.found = (path, "a module named at run time (the check cannot read which)")
                elif named is not None:
                    self._module(named, path)


def _lines(code: types.CodeType) -> set[int]:
    """The source lines of `code` itself (not of the functions it defines)."""
    return {line for _, _, line in code.co_lines() if line is not None}


def _hooks(value: Any, where: str) -> list[tuple[str, Any]]:
    """(where, callable) for every callable in a config value (dicts and lists walked)."""
    if callable(value):
        return [(where, value)]
    if isinstance(value, dict):
        return [h for k, v in value.items() for h in _hooks(v, f"{where}.{k}")]
    if isinstance(value, (list, tuple)):
        return [h for i, v in enumerate(value) for h in _hooks(v, f"{where}[{i}]")]
    return []


def remote_calls(task) -> str | None:
    """How the lm-eval task object `task` would call a remote service while it builds or scores
    ('process_results: judge -> ask uses openai'), or None."""
    hooks: list[tuple[str, Any]] = []
    config = task.config
    if is_dataclass(config):
        for f in fields(config):
            if f.name not in NOT_READ:
                hooks += _hooks(getattr(config, f.name), f.name)
    for name, functions in (("metric", getattr(task, "_metric_fn_list", {})),
                            ("aggregation", getattr(task, "_aggregation_list", {}))):
        hooks += [(f"{name} {key}", fn) for key, fn in dict(functions or {}).items() if callable(fn)]
    for ensemble in getattr(task, "_filters", []) or []:
        for step in getattr(ensemble, "filters", []) or []:
            hooks.append((f"filter {getattr(ensemble, 'name', '?')}", type(step)))
            hooks += _hooks(dict(vars(step)), f"filter {getattr(ensemble, 'name', '?')}")
    hooks.append((f"class {type(task).__qualname__}", type(task)))
    reader = _Reader()
    for where, hook in hooks:
        try:
            reader.callable(hook, [])
        except (RecursionError, TypeError, ValueError, AttributeError, OSError):  # code this reader cannot follow:
            continue  # the task is not refused for what could not be read
        if reader.found is not None:
            path, module = reader.found
            chain = " -> ".join(dict.fromkeys(path)) or getattr(hook, "__qualname__", "")
            return f"{where}: {chain} uses {module}"
    return None
