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


class NonFiniteScoreError(NanoEvalError):
    """The model gave a NaN or infinite log-prob (or NaN / inf logits while generating) for one of a task's documents:
    the task gets no score, since a NaN compares false and would read as accuracy 0. `task`: the task's key."""

    def __init__(self, message: str, *, task: str):
        super().__init__(message)
        self.task = task

    def __reduce__(self):  # errors travel between ranks pickled
        return type(self), (str(self),), {"task": self.task}


class TasksFailedError(NanoEvalError):
    """Some tasks failed while being scored; the others' results were written. Exit code 1 (a task's metric or
    data failed), or 2 when every failure was bad input (`bad_input`: the model gave non-finite scores)."""

    exit_code = 1

    def __init__(self, message: str, *, bad_input: bool = False):
        super().__init__(message)
        if bad_input:
            self.exit_code = 2
