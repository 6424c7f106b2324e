"""A lighteval custom task file (multiple choice), written for nano_eval's tests in lighteval's own style.

Only the imports differ from a lighteval file; in lighteval they read:
    from lighteval.metrics.metrics import Metrics
    from lighteval.metrics.normalizations import LogProbCharNorm, LogProbPMINorm, LogProbTokenNorm
    from lighteval.tasks.lighteval_task import LightevalTaskConfig
    from lighteval.tasks.requests import Doc
"""

from string import ascii_uppercase

from nano_eval.tasks.lighteval import Doc, LightevalTaskConfig, LogProbCharNorm, LogProbPMINorm, LogProbTokenNorm, Metrics


def arc_prompt(line, task_name: str = None):
    return Doc(
        task_name=task_name,
        query=f"Question: {line['question']}\nAnswer:",
        choices=[f" {c}" for c in line["choices"]["text"]],
        gold_index=line["choices"]["label"].index(line["answerKey"]),
        unconditioned_query="Answer:",
    )


def piqa_letters_prompt(line, task_name: str = None):
    """Letters for the evaluated document, the solution texts when the row is a few-shot example."""
    letters = list(ascii_uppercase)[:2]
    query = "The following are multiple choice questions (with answers) about common sense.\n"
    query += f"Question: {line['goal']}\n"
    query += "".join([f"{key}. {choice}\n" for key, choice in zip(letters, [line["sol1"], line["sol2"]])])
    query += "Answer: "
    is_few_shots = line.get("__few_shots", False)
    return Doc(
        task_name=task_name,
        query=query,
        choices=letters if not is_few_shots else [line["sol1"], line["sol2"]],
        gold_index=int(line["label"]),
        instruction="The following are multiple choice questions (with answers) about common sense.\n",
    )


arc_easy = LightevalTaskConfig(
    name="arc:easy",
    prompt_function=arc_prompt,
    hf_repo="allenai/ai2_arc",
    hf_subset="ARC-Easy",
    evaluation_splits=["validation"],
    few_shots_split=None,
    few_shots_select="random_sampling_from_train",
    generation_size=-1,
    metrics=[
        Metrics.loglikelihood_acc,
        Metrics.loglikelihood_acc(sample_params={"logprob_normalization": LogProbCharNorm(ignore_first_space=True)}),
        Metrics.loglikelihood_acc(sample_params={"logprob_normalization": LogProbTokenNorm()}),
        Metrics.loglikelihood_acc(sample_params={"logprob_normalization": LogProbPMINorm()}),
    ],
    stop_sequence=["\n"],
    version=0,
    sample_fields=None,  # inspect-ai fields of current lighteval configs: accepted, ignored
    solver=None,
    scorer=None,
)

piqa_letters = LightevalTaskConfig(
    name="piqa_letters",
    prompt_function=piqa_letters_prompt,
    hf_repo="baber/piqa",
    hf_subset="default",
    hf_avail_splits=["train", "validation"],
    evaluation_splits=["validation"],
    few_shots_split="train",
    few_shots_select="sequential",
    generation_size=1,
    metrics=[Metrics.exact_match],
    stop_sequence=["\n"],
    version=0,
)

TASKS_TABLE = [arc_easy, piqa_letters]
