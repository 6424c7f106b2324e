"""Jinja templates from files, rendered as untrusted code with bounded time and memory: a tokenizer's chat template,
and the prompt fields of an lm-eval task YAML (`doc_to_text`, `doc_to_choice`, ...: nano_eval.tasks.lm_eval_tasks).

A chat template is a Jinja program that comes with the checkpoint (tokenizer_config.json or chat_template.jinja);
an lm-eval task's fields come with its YAML. transformers renders chat templates in Jinja's sandbox, which stops
them from reaching Python internals but not from looping for hours (`range(100000)` inside `range(100000)`),
building a 5 GB string (`'x' * 5000000000`) or recursing until Python gives up; lm-eval renders its fields with no
sandbox at all (`{{ cycler.__init__.__globals__.os.system(...) }}` runs a command). `SandboxedTemplate` renders in
Jinja's immutable sandbox, configured as the caller's own environment (`bounded_environment`: transformers' globals
and filters for a chat template, lm-eval's for a task field, so a genuine template renders the same text), with a
budget per rendering:

- steps: every loop iteration, call, attribute or item lookup, filter and operator counts one; at most
  `MAX_STEPS` + `STEPS_PER_MESSAGE` per message (per `items` of the input; a genuine template takes tens per
  message), and at most `MAX_SECONDS` of wall time (checked at each step, and by nano_eval.time_limit's alarm
  within a single call such as a backtracking `regex_replace`, on the main thread);
- size: no string or list the template builds (by `*`, `+`, `~`, `%`, a filter or a method) and not the output
  may be longer than `max_chars` (1 MiB + 16 x the characters of the input), and all it builds together no
  more than `TOTAL_SIZES` x that; sizes are checked before the operation where the operation could allocate
  without bound (repetition, padding, `replace`, `join`), after it otherwise;
- numbers: integers of more than `MAX_INT_BITS` bits are refused (`9 ** 99999`);
- the template itself: at most `MAX_TEMPLATE_CHARS` (compiling 1 MB of `{{ x }}` took 24 s and 1.3 GB; genuine
  templates, tool-calling ones included, are under 20k characters).

A template past a limit, one that does not compile, raises or recurses past Python's limit raises
`TemplateRefused` (one line saying what it did); `ChatTemplate` turns that into a `ChatTemplateError` (a
NanoEvalError: one line, exit code 2) naming the tokenizer and the fix.
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any

from nano_eval.errors import NanoEvalError
from nano_eval.time_limit import TimeLimitExceeded, time_limit

MAX_STEPS = 20_000
STEPS_PER_MESSAGE = 2_000
MAX_SECONDS = 2.0
BASE_CHARS = 1 << 20
CHARS_PER_INPUT_CHAR = 16
MAX_INT_BITS = 4096
TOTAL_SIZES = 32
MAX_TEMPLATE_CHARS = 128 << 10
_WIDE_FORMAT = re.compile(r"\d{6,}|\*")  # a %-format or str.format width/precision of six digits or more, or `*`
# str methods that can multiply a string's length by an argument that is not a number (padding to a width is
# bounded by the check on numbers): a chat template never needs them
_REFUSED_STR_METHODS = {"expandtabs", "translate", "maketrans", "encode"}


class ChatTemplateError(NanoEvalError):
    """A chat template that cannot be rendered safely (syntax, recursion, past its budget)."""


class _OverBudget(Exception):
    """Raised inside a rendering that went past its budget; becomes a ChatTemplateError."""


def _sandbox_class():
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    class Guard(NodeTransformer):
        """Routes every loop's iterable and every `~` concatenation through the environment's budget."""

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_loop"), [node.iter], [], None, None)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return nodes.Call(nodes.EnvironmentAttribute("bounded_value"), [node], [], None, None)

        def visit_AssignBlock(self, node):  # `{% set x %}...{% endset %}`: the captured text, checked
            self.generic_visit(node)
            check = nodes.Filter(None, "nano_eval_bounded", [], [], None, None)
            if node.filter is None:
                node.filter = check
            else:
                innermost = node.filter
                while innermost.node is not None:
                    innermost = innermost.node
                innermost.node = check
            return node

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """Jinja's immutable sandbox with a step, time and size budget per rendering (`start` opens one)."""

        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.start(MAX_STEPS, BASE_CHARS)

        def start(self, max_steps: int, max_chars: int) -> None:
            self.steps_left, self.deadline, self.max_chars = max_steps, time.monotonic() + MAX_SECONDS, max_chars
            self.built_left = TOTAL_SIZES * max_chars

        def step(self, n: int = 1) -> None:
            self.steps_left -= n
            if self.steps_left < 0:
                raise _OverBudget("takes more steps than any genuine template needs (a loop or recursion without "
                                  "end?)")
            if time.monotonic() > self.deadline:
                raise _OverBudget(f"takes more than {MAX_SECONDS:g}s for one rendering")

        def size(self, n: int, what: str) -> None:
            if n > self.max_chars:
                raise _OverBudget(f"builds a {what} of {n:,} items, more than the {self.max_chars:,} a text from "
                                  "this input may need")

        def bounded_value(self, value):
            self.step()
            if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
                raise _OverBudget(f"builds an integer of {value.bit_length():,} bits")
            if isinstance(value, (str, list, tuple, dict)):
                self.size(len(value), type(value).__name__)
                self.built_left -= len(value)
                if self.built_left < 0:
                    raise _OverBudget(f"builds strings and lists of more than {TOTAL_SIZES * self.max_chars:,} "
                                      "items in all")
            return value

        def bounded_loop(self, iterable):
            for item in iterable:
                self.step()
                yield item

        def getattr(self, obj, attribute):
            self.step()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            self.step()
            return super().getitem(obj, argument)

        def call_binop(self, context, op: str, left, right):
            self.step()
            _check_binop(self, op, left, right)
            return self.bounded_value(super().call_binop(context, op, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 -- Jinja's own signature
            __self.step()
            _check_args(__self, args, kwargs)
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str):
                _check_str_method(__self, owner, getattr(method, "__name__", ""), args, kwargs)
            return __self.bounded_value(super().call(__context, __obj, *args, **kwargs))

        def _parse(self, source, name, filename):
            return Guard().visit(super()._parse(source, name, filename))

    return BoundedSandbox


def _sized(x) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple)) else None


def _check_int(env, value) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > env.max_chars:
        raise _OverBudget(f"passes the number {value:,}, more than any prompt needs")


def _check_args(env, args, kwargs) -> None:
    for a in (*args, *kwargs.values()):
        _check_int(env, a)


def _check_format(env, fmt: str) -> None:
    if _WIDE_FORMAT.search(fmt):
        raise _OverBudget("formats with a width or precision of a million or more (or `*`)")


def _check_binop(env, op: str, left, right) -> None:
    """Refuse, before computing it, an operation whose result would be past the budget."""
    ints = all(isinstance(x, int) and not isinstance(x, bool) for x in (left, right))
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if _sized(seq) is not None and isinstance(n, int):
                env.size(len(seq) * max(n, 0), type(seq).__name__)
        if ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _OverBudget(f"multiplies integers into one of more than {MAX_INT_BITS} bits")
    elif op == "**" and ints and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
        raise _OverBudget(f"raises {left} to the power {right:,}")
    elif op == "+" and _sized(left) is not None and _sized(right) is not None:
        env.size(len(left) + len(right), type(left).__name__)
    elif op == "%" and isinstance(left, str):
        _check_format(env, left)


def _check_str_method(env, s: str, name: str, args, kwargs) -> None:
    if name in _REFUSED_STR_METHODS:
        raise _OverBudget(f"calls str.{name}, which a chat template never needs")
    if name == "format":
        _check_format(env, s)
    elif name == "replace" and args:
        new = args[1] if len(args) > 1 else kwargs.get("new", "")
        if isinstance(new, str):
            env.size(len(s) + (len(s) + 1) * len(new), "str")
    elif name == "join":
        items = args[0] if args else ()
        if isinstance(items, (list, tuple)):
            env.size(len(s) * len(items) + sum(len(x) for x in items if isinstance(x, str)), "str")


def _bounded_filter(env, name: str, f):
    """`f` (a Jinja filter), counting a step, checking its arguments before and its result after."""

    passes_context = getattr(f, "jinja_pass_arg", None) is not None

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        env.step()
        values = list(args[1:] if passes_context else args)
        _check_args(env, values[1:], kwargs)
        value, rest = (values[0] if values else None), values[1:]
        if name == "format" and isinstance(value, str):
            _check_format(env, value)
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            env.size(len(value) + (value.count("\n") + 1) * pad, "str")
        elif name == "replace" and isinstance(value, str) and len(rest) > 1 and isinstance(rest[1], str):
            env.size(len(value) + (len(value) + 1) * len(rest[1]), "str")
        elif name == "join" and _sized(value) is not None:
            sep = rest[0] if rest else kwargs.get("d", "")
            env.size(len(value) * (len(sep) if isinstance(sep, str) else 1), "str")
        elif name == "wordwrap" and isinstance(value, str):
            wrap = rest[3] if len(rest) > 3 else kwargs.get("wrapstring") or "\n"
            env.size(len(value) * (1 + len(wrap)), "str")
        elif name == "tojson":
            indent = rest[1] if len(rest) > 1 else kwargs.get("indent")
            if isinstance(indent, str) and len(indent) > 16 or isinstance(indent, int) and indent > 16:
                raise _OverBudget("indents JSON by more than 16")
        return env.bounded_value(f(*args, **kwargs))

    return bounded


@functools.lru_cache(maxsize=8)
def _bounded_lipsum(env, lipsum):
    """Jinja's global lipsum(n, html, min, max) writes up to n * max words in one call, which no step or time check
    interrupts (`lipsum(1000, false, 999999, 1000000)`: hours): refused unless that many words fit the prompt's size
    budget (8 characters a word)."""

    def bounded(n=5, html=True, min=20, max=100):  # noqa: A002 -- Jinja's own argument names
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (n, min, max)):
            raise _OverBudget(f"calls lipsum() with {n!r:.20}, {min!r:.20}, {max!r:.20}, not integers")
        if n * max > env.max_chars // 8:
            raise _OverBudget(f"asks lipsum() for up to {n * max:,} words, more than any prompt needs")
        return lipsum(n, html, min, max)

    return bounded


def bounded_environment(options: dict[str, Any], globals_: dict[str, Any], filters: dict[str, Any]):
    """A BoundedSandbox made with the Jinja Environment keyword arguments `options`, holding `globals_` and
    `filters` (on top of Jinja's own), every filter bounded; `lipsum` bounded too."""
    import jinja2

    env = _sandbox_class()(**options)
    env.globals.update(globals_)
    if "lipsum" in env.globals:
        env.globals["lipsum"] = _bounded_lipsum(env, env.globals["lipsum"])
    filters = {**env.filters, **filters}
    filters["nano_eval_bounded"] = jinja2.pass_environment(lambda e, v: e.bounded_value(v))
    env.filters = {name: f if name == "nano_eval_bounded" else _bounded_filter(env, name, f)
                   for name, f in filters.items()}
    return env


class TemplateRefused(Exception):
    """A template that cannot be compiled or rendered within its budget; the message says what it did, on one
    line (the caller names the file and the fix)."""


class SandboxedTemplate:
    """`source` compiled in `env` (a `bounded_environment`); `render(variables, input_chars, items)` -> the text,
    within the budget for an input of `input_chars` characters and `items` messages (or fields)."""

    def __init__(self, env, source: str):
        self.env = env
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateRefused(f"is {len(source):,} characters long, more than any template needs "
                                  f"({MAX_TEMPLATE_CHARS:,}); compiling it would take minutes and gigabytes")
        try:
            self.template = env.from_string(source)
        except RecursionError:
            raise TemplateRefused("nests deeper than Python can compile") from None
        except Exception as e:  # noqa: BLE001 -- jinja2.TemplateSyntaxError and the errors of its extensions
            raise TemplateRefused(f"does not compile ({type(e).__name__}: {_one_line(e)})") from None

    def render(self, variables: dict[str, Any], input_chars: int, items: int) -> str:
        self.env.start(MAX_STEPS + STEPS_PER_MESSAGE * items, BASE_CHARS + CHARS_PER_INPUT_CHAR * input_chars)
        out, n = [], 0
        try:
            with time_limit(MAX_SECONDS + 1):  # also within one call no step sees (a backtracking regex_replace)
                for chunk in self.template.generate(**variables):
                    n += len(chunk)
                    self.env.size(n, "text")
                    self.env.step()
                    out.append(chunk)
        except TimeLimitExceeded:
            raise TemplateRefused(f"takes more than {MAX_SECONDS:g}s for one rendering (within one filter call: a "
                                  "regular expression that backtracks?)") from None
        except _OverBudget as e:
            raise TemplateRefused(str(e)) from None
        except RecursionError:
            raise TemplateRefused("recurses past Python's limit") from None
        except MemoryError:
            raise TemplateRefused("ran out of memory") from None
        except Exception as e:  # noqa: BLE001 -- raise_exception(), undefined names, type errors: the template's own
            raise TemplateRefused(f"fails ({type(e).__name__}: {_one_line(e)})") from None
        return "".join(out)


def _environment():
    """A bounded environment configured as transformers configures its chat-template environment (its globals,
    filters and extensions, taken from a template transformers compiles)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    reference = _compile_jinja_template("").environment
    return bounded_environment(
        {"trim_blocks": True, "lstrip_blocks": True, "extensions": [type(e) for e in reference.extensions.values()]},
        reference.globals, reference.filters)


class ChatTemplate:
    """A compiled chat template: `render(messages)` -> the prompt text, ending with the assistant turn's opener
    (add_generation_prompt=True). `name` names the tokenizer in errors."""

    def __init__(self, source: str, name: str, variables: dict[str, Any] | None = None):
        self.name = name
        self.variables = dict(variables or {})
        try:
            self.template = SandboxedTemplate(_environment(), source)
        except TemplateRefused as e:
            raise self._error(str(e)) from None

    def render(self, messages: list[dict]) -> str:
        chars = sum(len(str(m.get("content", ""))) for m in messages)
        try:
            return self.template.render({**self.variables, "messages": messages, "tools": None, "documents": None,
                                         "add_generation_prompt": True}, chars, len(messages))
        except TemplateRefused as e:
            raise self._error(str(e)) from None

    def _error(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(
            f"the chat template of tokenizer {self.name} {what}. Fix: use a tokenizer whose chat template renders "
            "(the instruct model's own tokenizer_config.json), or leave --use-chat-template off.")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]

