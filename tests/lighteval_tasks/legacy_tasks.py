"""A lighteval custom task file in the older style (lighteval < 0.8, still the style of lighteval's nanotron example),
written for nano_eval's tests: prompt functions take only `line` and return a dict of Doc fields, the config field is
`metric`, few-shot examples switch their choices on `line["__few_shots"]`, and the file imports inspect-ai scorer
names that current lighteval defines in `lighteval.metrics.metrics`.

Only the imports differ from a lighteval file; in lighteval they read:
    from lighteval.metrics import Metrics
    from lighteval.metrics.metrics import math_scorer
    from lighteval.tasks.lighteval_task import LightevalTaskConfig, TextGenerationInputGrammarType
"""

from nano_eval.tasks.lighteval import Metrics, math_scorer
from nano_eval.tasks.lighteval import LightevalTaskConfig, TextGenerationInputGrammarType

LABELS = ["A", "B", "C", "D", "E"]


def arc_letters(line):
    labels = LABELS[: len(line["choices"]["text"])]
    query = f"Question: {line['question']}\n"
    query += "".join(f"{key}. {text}\n" for key, text in zip(labels, line["choices"]["text"]))
    query += "Answer:"
    gold = line["choices"]["label"].index(line["answerKey"])
    is_few_shots = line.get("__few_shots", False)
    return {
        "query": query,
        "choices": [f" {k}" for k in labels] if is_few_shots else labels,
        "fewshot_sorting_class": labels[gold],
        "gold_index": gold,
        "instruction": "",
    }


TASKS_TABLE = [
    LightevalTaskConfig(
        name="arc:letters",
        prompt_function=arc_letters,
        hf_repo="allenai/ai2_arc",
        hf_subset="ARC-Easy",
        hf_avail_splits=["train", "validation", "test"],
        evaluation_splits=["validation"],
        few_shots_split="validation",
        few_shots_select="sequential",
        generation_size=5,
        metric=[Metrics.loglikelihood_acc],
        stop_sequence=["\n"],
        scorer=math_scorer(),
    ),
    LightevalTaskConfig(
        name="arc:letters_grammar",
        prompt_function=arc_letters,
        hf_repo="allenai/ai2_arc",
        hf_subset="ARC-Easy",
        evaluation_splits=["validation"],
        generation_size=5,
        generation_grammar=TextGenerationInputGrammarType(type="regex", value="[A-E]"),
        metric=[Metrics.exact_match],
        stop_sequence=["\n"],
    ),
]
