"""User-facing errors."""


class NanoEvalError(Exception):
    """A user-facing error whose message names the thing and the fix; entry points print it without a traceback."""
