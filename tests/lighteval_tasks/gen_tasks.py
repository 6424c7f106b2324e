"""A lighteval custom task file (generative, parametrised metrics), in lighteval's style, for nano_eval's tests.

Only the imports differ from a lighteval file (`lighteval.metrics.metrics`, `lighteval.metrics.normalizations`,
`lighteval.tasks.lighteval_task`, `lighteval.tasks.requests` in lighteval). The data is nano_eval's demo file.
"""

from nano_eval.tasks.demo_tasks import DATA
from nano_eval.tasks.lighteval import Doc, LightevalTaskConfig, Metrics, helm_normalizer


def arithmetic_prompt(line, task_name: str = None):
    return Doc(
        task_name=task_name,
        query=f"Question: {line['a']} plus {line['b']}\nAnswer:",
        choices=[f" {line['a'] + line['b']}"],
        gold_index=0,
    )


TASKS_TABLE = [
    LightevalTaskConfig(
        name="arithmetic_gen",
        prompt_function=arithmetic_prompt,
        hf_repo=str(DATA / "arithmetic.jsonl"),
        hf_subset="default",
        hf_avail_splits=["validation"],
        evaluation_splits=["validation"],
        few_shots_split="validation",
        few_shots_select="random_sampling",
        generation_size=4,
        metrics=[
            Metrics.exact_match,
            Metrics.exact_match(sample_params={"normalize_gold": helm_normalizer, "normalize_pred": helm_normalizer}),
            Metrics.maj_at_n(sample_params={"n": 2}),
        ],
        stop_sequence=["\n"],
        num_samples=[1, 2],
    )
]
