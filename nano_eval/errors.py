"""User-facing errors."""


class NanoEvalError(Exception):
    """A user-facing error whose message names the thing and the fix; entry points print it without a traceback.

    `exit_code`: what the command line exits with (2: bad input)."""

    exit_code = 2


class BadDocumentError(NanoEvalError):
    """A task's document cannot be scored (gold index out of range, no choices, empty continuation); `task` is
    the task's name ("suite|task"), so a caller that may go on without it (the training hook) knows which one."""

    def __init__(self, message: str, *, task: str):
        super().__init__(message)
        self.task = task

    def __reduce__(self):  # errors travel between ranks pickled
        return _with_task, (type(self), str(self), self.task)


def _with_task(cls: type, message: str, task: str) -> NanoEvalError:
    """Unpickles an error made with (message, task=...)."""
    return cls(message, task=task)


class UnsupportedTaskError(BadDocumentError):
    """A task uses something nano_eval cannot run (a metric, a config field, a prompt template); raised when the task
    is selected, so the other tasks of its file still list and run (the training hook skips it with a warning)."""


class TaskCodeError(BadDocumentError):
    """A task's own code (an lm-eval task's hooks, metrics or Task class: the include path's Python, or lm-eval's
    catalogue) raised what would end the process (`sys.exit`: SystemExit, or another BaseException but Ctrl-C's
    KeyboardInterrupt) while the task loaded, built its requests or was scored: that task fails, in one line, and
    the others go on (the training hook goes on training)."""


class NonFiniteScoreError(NanoEvalError):
    """The model gave a NaN or infinite log-prob (or NaN / inf logits while generating) for one of a task's documents:
    the task gets no score, since a NaN compares false and would read as accuracy 0. `task`: the task's key."""

    def __init__(self, message: str, *, task: str):
        super().__init__(message)
        self.task = task

    def __reduce__(self):  # errors travel between ranks pickled
        return _with_task, (type(self), str(self), self.task)


class TasksFailedError(NanoEvalError):
    """Some tasks failed while being scored; the others' results were written. Exit code 1 (a task's metric or
    data failed), or 2 when every failure was bad input (`bad_input`: the model gave non-finite scores)."""

    exit_code = 1

    def __init__(self, message: str, *, bad_input: bool = False):
        super().__init__(message)
        if bad_input:
            self.exit_code = 2


class EvaluationFailed(NanoEvalError):
    """A fault on some ranks ended the evaluation on every rank together (nano_eval.agreement). Raised on every rank
    with the same message; on a failing rank it is chained to that rank's own error (`__cause__`).

    failures: [(rank, one-line message)] in rank order; exit code: the first failing rank's (2 when its error was a
    NanoEvalError, i.e. bad input; 1 for anything else)."""

    def __init__(self, failures: list[tuple[int, str]], exit_code: int = 1):
        super().__init__(f"the evaluation failed on {describe_failures(failures)}")
        self.failures, self.exit_code = failures, exit_code


def describe_failures(failures: list[tuple[int, str]]) -> str:
    """"rank 1: <message>", or "ranks 0, 1 (first: rank 0): <message>"."""
    ranks = ", ".join(str(r) for r, _ in failures)
    first_rank, first = failures[0]
    more = f" (first: rank {first_rank})" if len(failures) > 1 else ""
    return f"rank{'s' if len(failures) > 1 else ''} {ranks}{more}: {first}"


def is_rust_panic(error: BaseException) -> bool:
    """A Rust library's panic surfacing in Python (pyo3's PanicException, e.g. the tokenizers library on a regex past
    Onig's retry limit): a BaseException, so `except Exception` misses it; it says nothing about the process's
    state, so it is one bad input like any other."""
    return type(error).__name__ == "PanicException"
