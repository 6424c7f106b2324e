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


class UnsupportedTaskError(BadDocumentError):
    """A task uses something nano_eval cannot run (a metric, a config field, a prompt template); raised when the task
    is selected, so the other tasks of its file still list and run (the training hook skips it with a warning)."""


class TasksFailedError(NanoEvalError):
    """Some tasks failed while being scored; the others' results were written. Exit code 1 (not bad input)."""

    exit_code = 1


def is_rust_panic(error: BaseException) -> bool:
    """A Rust library's panic surfacing in Python (pyo3's PanicException, e.g. the tokenizers library on a regex past
    Onig's retry limit): a BaseException, so `except Exception` misses it; it says nothing about the process's
    state, so it is one bad input like any other."""
    return type(error).__name__ == "PanicException"
