"""Prompt functions of the multiple-choice tasks, in both formulations (see `formats`).

Each dataset has one parser (row -> `Item`, or None for unlabeled rows) and two prompt functions: the cloze one
reproduces lm-evaluation-harness's prompt for that task where lm-eval has a cloze task (hellaswag, arc_easy,
arc_challenge, piqa, boolq, openbookqa, social_iqa, mmlu_*_continuation), so the two tools score the same strings;
`*_mc` is the letter formulation (lm-eval's commonsense_qa and mmlu_* use exactly it). In the docstrings `|` separates
the query from the choices and `{x}` is a row field.
"""

from __future__ import annotations

import re

from nano_eval.tasks.requests import Doc
from nano_eval.tasks.suite.formats import ANSWER_CUE, Item, cloze, letter

# ---- parsers: row -> Item ----------------------------------------------------------------------------------------


def _hellaswag_clean(text: str) -> str:
    """lm-eval's cleanup of WikiHow artifacts: " [title]" ends a sentence, other [tags] go."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(line: dict) -> Item | None:
    if line["label"] in ("", None):  # the test split is unlabeled
        return None
    context = _hellaswag_clean(line["activity_label"] + ": " + line["ctx_a"] + " " + line["ctx_b"].capitalize())
    return Item(context, [_hellaswag_clean(e) for e in line["endings"]], int(line["label"]))


def _labeled(question: str, choices: dict, key: str) -> Item | None:
    """ARC / OpenBookQA / CommonsenseQA rows: {"text": [...], "label": ["A", ...]} and the gold label."""
    key = key.strip()
    return Item(question, list(choices["text"]), choices["label"].index(key)) if key else None


def _piqa(line: dict) -> Item | None:
    label = int(line["label"])
    return Item(line["goal"], [line["sol1"], line["sol2"]], label) if label >= 0 else None  # test: label -1


def _winogrande(line: dict) -> Item | None:
    answer = str(line["answer"]).strip()
    return Item(line["sentence"], [line["option1"], line["option2"]], int(answer) - 1) if answer else None


def _siqa(line: dict) -> Item:
    return Item(f"{line['context']} {line['question']}", [line["answerA"], line["answerB"], line["answerC"]],
                int(line["label"]) - 1)


def _mmlu(line: dict) -> Item:
    return Item(line["question"].strip(), list(line["choices"]), int(line["answer"]))


def _mmlu_subject(line: dict) -> str:
    return line["subject"].replace("_", " ")


# ---- cloze and letter prompt functions ----------------------------------------------------------------------------


def hellaswag(line: dict, task_name: str) -> Doc | None:
    """`{activity_label}: {ctx_a} {ctx_b capitalised}` | ` {ending}` ([tags] cleaned as lm-eval does)."""
    item = _hellaswag(line)
    return item and cloze(task_name, item.question, item)


def hellaswag_mc(line: dict, task_name: str) -> Doc | None:
    """`{activity_label}: {ctx}\\nA. {ending 0}\\n...\\nD. {ending 3}\\nAnswer:` | ` A` ... ` D`."""
    item = _hellaswag(line)
    return item and letter(task_name, item, prefix="")


def arc(line: dict, task_name: str) -> Doc | None:
    """`Question: {question}\\nAnswer:` | ` {choice text}` (lm-eval's arc_easy / arc_challenge)."""
    item = _labeled(line["question"], line["choices"], line["answerKey"])
    return item and cloze(task_name, f"Question: {item.question}\nAnswer:", item, uncond=ANSWER_CUE)


def arc_mc(line: dict, task_name: str) -> Doc | None:
    """`Question: {question}\\nA. {text}\\nB. {text}...\\nAnswer:` | ` A` ... (letters by position, also for the
    few rows labeled 1-4)."""
    item = _labeled(line["question"], line["choices"], line["answerKey"])
    return item and letter(task_name, item)


def piqa(line: dict, task_name: str) -> Doc | None:
    """`Question: {goal}\\nAnswer:` | ` {sol1}`, ` {sol2}` (lm-eval's piqa)."""
    item = _piqa(line)
    return item and cloze(task_name, f"Question: {item.question}\nAnswer:", item, uncond=ANSWER_CUE)


def piqa_mc(line: dict, task_name: str) -> Doc | None:
    """`Question: {goal}\\nA. {sol1}\\nB. {sol2}\\nAnswer:` | ` A`, ` B`."""
    item = _piqa(line)
    return item and letter(task_name, item)


def winogrande(line: dict, task_name: str) -> Doc | None:
    """`{sentence before _}` | ` {option} {sentence after _}`: the whole completed sentence is scored (lighteval's
    formulation; lm-eval scores only the words after the blank, after one context per option)."""
    item = _winogrande(line)
    if item is None:
        return None
    before, after = line["sentence"].split("_", 1)
    endings = Item(before.rstrip(), [option + after for option in item.options], item.gold)
    return cloze(task_name, endings.question, endings)


def winogrande_mc(line: dict, task_name: str) -> Doc | None:
    """`Question: {sentence with _}\\nA. {option1}\\nB. {option2}\\nAnswer:` | ` A`, ` B`."""
    item = _winogrande(line)
    return item and letter(task_name, item)


def boolq(line: dict, task_name: str) -> Doc:
    """`{passage}\\nQuestion: {question}?\\nAnswer:` | ` no`, ` yes` (lm-eval's boolq). Reads google/boolq rows
    (`answer`: bool) and super_glue rows (`label`: 0/1) alike."""
    gold = int(line["label"]) if "label" in line else int(bool(line["answer"]))
    item = Item(f"{line['passage']}\nQuestion: {line['question']}?\nAnswer:", ["no", "yes"], gold)
    return cloze(task_name, item.question, item)


def openbookqa(line: dict, task_name: str) -> Doc | None:
    """`{question_stem}` | ` {choice text}` (lm-eval's openbookqa: no question/answer cue)."""
    item = _labeled(line["question_stem"], line["choices"], line["answerKey"])
    return item and cloze(task_name, item.question, item)


def openbookqa_mc(line: dict, task_name: str) -> Doc | None:
    """`Question: {question_stem}\\nA. {text}\\n...\\nD. {text}\\nAnswer:` | ` A` ... ` D`."""
    item = _labeled(line["question_stem"], line["choices"], line["answerKey"])
    return item and letter(task_name, item)


def siqa(line: dict, task_name: str) -> Doc:
    """`Q: {context} {question}\\nA:` | ` {answerA}`, ` {answerB}`, ` {answerC}` (lm-eval's social_iqa)."""
    item = _siqa(line)
    return cloze(task_name, f"Q: {item.question}\nA:", item, uncond="A:")


def siqa_mc(line: dict, task_name: str) -> Doc:
    """`Question: {context} {question}\\nA. {answerA}\\nB. {answerB}\\nC. {answerC}\\nAnswer:` | ` A`, ` B`, ` C`."""
    return letter(task_name, _siqa(line))


def commonsense_qa(line: dict, task_name: str) -> Doc | None:
    """`Question: {question}\\nAnswer:` | ` {choice text}` (lm-eval has no cloze CommonsenseQA)."""
    item = _labeled(line["question"].strip(), line["choices"], line["answerKey"])
    return item and cloze(task_name, f"Question: {item.question}\nAnswer:", item, uncond=ANSWER_CUE)


def commonsense_qa_mc(line: dict, task_name: str) -> Doc | None:
    """`Question: {question}\\nA. {text}\\n...\\nE. {text}\\nAnswer:` | ` A` ... ` E` (lm-eval's commonsense_qa)."""
    item = _labeled(line["question"].strip(), line["choices"], line["answerKey"])
    return item and letter(task_name, item)


def mmlu(line: dict, task_name: str) -> Doc:
    """`The following are questions (with answers) about {subject}.\\n\\nQuestion: {question}\\nAnswer:` |
    ` {choice}` (lm-eval's mmlu_{subject}_continuation; the first line is the instruction, printed once)."""
    head = f"The following are questions (with answers) about {_mmlu_subject(line)}.\n\n"
    item = _mmlu(line)
    return cloze(task_name, f"Question: {item.question}\nAnswer:", item, uncond=ANSWER_CUE, instruction=head)


def mmlu_mc(line: dict, task_name: str) -> Doc:
    """`The following are multiple choice questions (with answers) about {subject}.\\n\\n{question}\\nA. {choice}
    \\n...\\nD. {choice}\\nAnswer:` | ` A` ... ` D` (lm-eval's mmlu_{subject})."""
    head = f"The following are multiple choice questions (with answers) about {_mmlu_subject(line)}.\n\n"
    return letter(task_name, _mmlu(line), prefix="", instruction=head)
