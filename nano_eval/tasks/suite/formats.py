"""The two multiple-choice formulations every suite task is built from, so no task spells out its own format.

- cloze: each answer text is scored as a continuation of the question (`" " + answer`: the leading space is
  lm-eval's `target_delimiter`). Small models score above chance here long before they can read a letter list.
- letter: the question lists the options as "A. ...", "B. ..." and ends with "Answer:"; the choices are " A", " B",
  ... (one token each in common tokenizers). Only models that learned the format beat chance on it.
"""

from __future__ import annotations

from typing import NamedTuple

from nano_eval.tasks.requests import Doc

LETTERS = "ABCDEFGHIJ"
ANSWER_CUE = "Answer:"


class Item(NamedTuple):
    """One multiple-choice question before any formulation: what a dataset row parses to."""

    question: str
    options: list[str]
    gold: int


def cloze(task_name: str, query: str, item: Item, *, uncond: str | None = None, instruction: str = "") -> Doc:
    """`instruction + query`, choices `" " + option`; `uncond` is the answer cue PMI scores against (acc_norm_pmi)."""
    return Doc(
        task_name=task_name,
        query=instruction + query,
        choices=[" " + option for option in item.options],
        gold_index=item.gold,
        instruction=instruction,
        unconditioned_query=uncond,
    )


def letter(task_name: str, item: Item, *, prefix: str = "Question: ", instruction: str = "") -> Doc:
    """`instruction + prefix + question`, one "X. option" line per option, then "Answer:"; choices " A", " B", ..."""
    letters = LETTERS[: len(item.options)]
    lines = [prefix + item.question] + [f"{x}. {option}" for x, option in zip(letters, item.options)] + [ANSWER_CUE]
    return Doc(
        task_name=task_name,
        query=instruction + "\n".join(lines),
        choices=[" " + x for x in letters],
        gold_index=item.gold,
        instruction=instruction,
        unconditioned_query=ANSWER_CUE,
    )
