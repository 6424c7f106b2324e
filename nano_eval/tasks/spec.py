"""A task spec, `suite|task|num_fewshot`, as the registry and other harnesses' adapters (nano_eval.tasks.lm_eval_tasks)
parse it, and the error a bad one raises."""

from __future__ import annotations

from dataclasses import dataclass

from nano_eval.errors import NanoEvalError


class TaskSpecError(NanoEvalError, ValueError):
    """A malformed or unknown task spec; a ValueError too, since it is bad input to `parse_specs`."""


@dataclass(frozen=True, kw_only=True)
class TaskSpec:
    suite: str
    task: str
    num_fewshot: int

    @property
    def full_name(self) -> str:
        return f"{self.suite}|{self.task}"

    @property
    def key(self) -> str:
        """The results key: the same task at two shot counts gives two results."""
        return f"{self.full_name}|{self.num_fewshot}"
