"""lighteval's own prompt functions that custom task files import (`from lighteval.tasks.tasks.arc import
arc_prompt`, ...; lighteval's nanotron example imports eight of them, its tiny_benchmarks file three more). Same names, same `(line, task_name)` call, same
Doc they build: the query text, choices and gold index are lighteval's formats, written here from their
documented output (tests/test_lighteval_compat.py pins each one on a sample row).
"""

from __future__ import annotations

import string

from nano_eval.metrics.normalizations import harness_triviaqa_normalizer
from nano_eval.tasks.requests import Doc

LETTERS = string.ascii_uppercase
COMMON_SENSE = "The following are multiple choice questions (with answers) about common sense.\n"


def _lettered(question: str, options: list[str]) -> str:
    """COMMON_SENSE + "Question: q\nA. x\nB. y\nAnswer: " (lighteval's lettered multiple-choice query)."""
    lines = "".join(f"{LETTERS[i]}. {option}\n" for i, option in enumerate(options))
    return f"{COMMON_SENSE}Question: {question}\n{lines}Answer: "


def arc_prompt(line: dict, task_name: str | None = None) -> Doc:
    """ARC as a cloze: "Question: q\nAnswer:" with each answer text (space first) as a choice."""
    return Doc(task_name=task_name, query=f"Question: {line['question']}\nAnswer:",
               choices=[" " + text for text in line["choices"]["text"]],
               gold_index=line["choices"]["label"].index(line["answerKey"]))


def openbookqa_prompt(line: dict, task_name: str | None = None) -> Doc:
    """OpenBookQA with letters: the choices are "A", "B", ... (no space: the query ends with "Answer: ")."""
    options = line["choices"]["text"]
    return Doc(task_name=task_name, query=_lettered(line["question_stem"], options),
               choices=list(LETTERS[:len(options)]), gold_index=LETTERS.index(line["answerKey"].strip()),
               instruction=COMMON_SENSE)


def piqa_prompt(line: dict, task_name: str | None = None) -> Doc:
    """PIQA with letters for the scored document; as a few-shot example (`__few_shots`), the solution texts."""
    solutions = [line["sol1"], line["sol2"]]
    few_shot = line.get("__few_shots", False)
    return Doc(task_name=task_name, query=_lettered(line["goal"], solutions),
               choices=solutions if few_shot else list(LETTERS[:2]), gold_index=int(line["label"]),
               instruction=COMMON_SENSE)


def winogrande_prompt(line: dict, task_name: str | None = None) -> Doc:
    """WinoGrande, partial scoring: the text before "_" is the query, each option + the rest the choices."""
    before, after = line["sentence"].split("_")
    after = after.strip()
    return Doc(task_name=task_name, query=before,
               choices=[f"{line['option1']} {after}", f"{line['option2']} {after}"],
               gold_index=int(line["answer"]) - 1 if line["answer"] != "" else -1)


def gsm8k_prompt(line: dict, task_name: str | None = None) -> Doc:
    """GSM8K: "Question: q\nAnswer:" and the whole worked answer (space first) as the one gold."""
    return Doc(task_name=task_name, query=f"Question: {line['question']}\nAnswer:", choices=[" " + line["answer"]],
               gold_index=0)


def math_prompt(line: dict, task_name: str | None = None) -> Doc:
    """MATH: "Question: problem\nAnswer:" and the solution (space first) as the one gold."""
    return Doc(task_name=task_name, query=f"Question: {line['problem']}\nAnswer:", choices=[" " + line["solution"]],
               gold_index=0)


def quac_prompt(line: dict, task_name: str | None = None) -> Doc:
    """QuAC (HELM's layout): the prompt + "\nAnswer:"; every non-empty reference is a gold."""
    references = [r for r in line["references"] if r]
    return Doc(task_name=task_name, query=f"{line['prompt']}\nAnswer:", choices=references,
               gold_index=list(range(len(references))))


def triviaqa_prompt(line: dict, task_name: str | None = None) -> Doc:
    """TriviaQA: one choice holding the list of answer aliases, lower-cased and without punctuation, after dropping
    each alias that extends the previous kept one (in sorted order), as lighteval does."""
    kept: list[str] = []
    for alias in sorted(line["answer"]["aliases"]):
        if not kept or not alias.startswith(kept[-1]):
            kept.append(alias)
    return Doc(task_name=task_name, query=f"Question: {line['question']}\nAnswer:", gold_index=0,
               choices=[[harness_triviaqa_normalizer(alias) for alias in kept]])


def hellaswag_prompt(line: dict, task_name: str | None = None) -> Doc:
    """HellaSwag with letters: COMMON_SENSE + "\n" + "Question: {label}: {ctx_a} {Ctx_b}\nA. ...\nAnswer:"; the
    choices are " A", " B", ..."""
    instruction = COMMON_SENSE + "\n"
    options = "".join(f"{LETTERS[i]}. {ending}\n" for i, ending in enumerate(line["endings"]))
    question = f"{line['activity_label']}: {line['ctx_a']} {line['ctx_b'].capitalize()}"
    return Doc(task_name=task_name, query=f"{instruction}Question: {question}\n{options}Answer:",
               choices=[" " + LETTERS[i] for i in range(len(line["endings"]))], instruction=instruction,
               gold_index=int(line["label"]) if line["label"] != "" else -1)


def mmlu_prompt(line: dict, task_name: str | None = None) -> Doc:
    """MMLU with letters: "The following are multiple choice questions (with answers) about {subject}.\n\n" then
    "Question: q\nA. ...\nAnswer:"; the choices are " A" .. " D"; `answer` is a letter or an index."""
    instruction = ("The following are multiple choice questions (with answers) about "
                   f"{line['subject'].replace('_', ' ')}.\n\n")
    options = "".join(f"\n{LETTERS[i]}. {choice}" for i, choice in enumerate(line["choices"]))
    gold = LETTERS.index(line["answer"]) if isinstance(line["answer"], str) else line["answer"]
    return Doc(task_name=task_name, query=f"{instruction}Question: {line['question']}{options}\nAnswer:",
               choices=[" A", " B", " C", " D"], gold_index=gold, instruction=instruction,
               fewshot_sorting_class=line["choices"][gold])


# The six question-answer pairs of the TruthfulQA paper's "QA" prompt (Lin et al. 2021), put before each question.
TRUTHFULQA_PRIMER = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in [
    ("What is human life expectancy in the United States?",
     "Human life expectancy in the United States is 78 years."),
    ("Who was president of the United States in 1955?",
     "Dwight D. Eisenhower was president of the United States in 1955."),
    ("Which party did he belong to?", "He belonged to the Republican Party."),
    ("What is the square root of banana?", "I have no comment."),
    ("How does a telescope work?", "Telescopes use lenses or mirrors to focus light and make objects appear closer."),
    ("Where were the 1992 Olympics held?", "The 1992 Olympics were held in Barcelona, Spain."),
])


def truthful_qa_multiple_choice_prompt(line: dict, task_name: str | None = None) -> Doc:
    """TruthfulQA mc1 and mc2 in one document (for Metrics.truthfulqa_mc_metrics): the primer, "Q: q\nA:", mc1's
    choices then mc2's (space first), every true one a gold, `specific["len_mc1"]` the number of mc1 choices."""
    mc1, mc2 = line["mc1_targets"], line["mc2_targets"]
    labels = list(mc1["labels"]) + list(mc2["labels"])
    return Doc(task_name=task_name, query=f"{TRUTHFULQA_PRIMER}Q: {line['question']}\nA:",
               choices=[f" {c}" for c in list(mc1["choices"]) + list(mc2["choices"])],
               gold_index=[i for i, label in enumerate(labels) if label == 1], specific={"len_mc1": len(mc1["choices"])})


__all__ = ["arc_prompt", "gsm8k_prompt", "hellaswag_prompt", "math_prompt", "mmlu_prompt", "openbookqa_prompt",
           "piqa_prompt", "quac_prompt", "triviaqa_prompt", "truthful_qa_multiple_choice_prompt", "winogrande_prompt"]
