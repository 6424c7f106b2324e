"""The `demo` suite: tiny arithmetic tasks whose data ships inside the package, one per request type.

They exist so that `python nano_eval/run.py --demo` and the tests run end to end with no download.
"""

from __future__ import annotations

from pathlib import Path

from nano_eval.tasks.config import TaskConfig
from nano_eval.tasks.requests import Doc

DATA = Path(__file__).parent / "data"


def arithmetic_choice(line: dict, task_name: str) -> Doc:
    return Doc(
        task_name=task_name,
        query=f"Question: {line['a']} plus {line['b']}\nAnswer:",
        choices=[f" {c}" for c in line["choices"]],
        gold_index=int(line["label"]),
        unconditioned_query="Answer:",
    )


def arithmetic_generate(line: dict, task_name: str) -> Doc:
    return Doc(task_name=task_name, query=f"Question: {line['a']} plus {line['b']}\nAnswer:",
               choices=[f" {line['a'] + line['b']}"], gold_index=0)


def text(line: dict, task_name: str) -> Doc:
    return Doc(task_name=task_name, query=line["text"], choices=[], gold_index=0)


DEMO_TASKS: list[TaskConfig] = [
    TaskConfig(
        name="arithmetic",
        prompt_function=arithmetic_choice,
        hf_repo=str(DATA / "arithmetic.jsonl"),
        metrics=("acc", "acc_norm", "acc_norm_token", "acc_norm_pmi", "prob_norm_gold", "bits_per_byte_gold"),
        few_shots_split="validation",
        suite=("demo",),
    ),
    TaskConfig(
        name="arithmetic_gen",
        prompt_function=arithmetic_generate,
        hf_repo=str(DATA / "arithmetic.jsonl"),
        metrics=("exact_match", "quasi_exact_match"),
        generation_size=4,
        stop_sequence=("\n",),
        few_shots_split="validation",
        suite=("demo",),
    ),
    TaskConfig(
        name="arithmetic_ppl",
        prompt_function=text,
        hf_repo=str(DATA / "arithmetic_text.jsonl"),
        metrics=("word_perplexity", "byte_perplexity", "bits_per_byte"),
        suite=("demo",),
    ),
]
