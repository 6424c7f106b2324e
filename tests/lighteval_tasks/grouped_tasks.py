"""A lighteval custom task file with a grouped metric and TASKS_GROUPS, in lighteval's style, for nano_eval's tests.

Only the imports differ from a lighteval file (`lighteval.metrics.utils.metric_utils`, `lighteval.tasks.requests`,
`lighteval.tasks.lighteval_task`, `lighteval.models.model_output` in lighteval).
"""

import numpy as np

from nano_eval.tasks.lighteval import (Doc, LightevalTaskConfig, Metrics, ModelResponse, SampleLevelMetric,
                                       SampleLevelMetricGrouping, SamplingMethod)


def arc_prompt(line, task_name: str = None):
    return Doc(
        task_name=task_name,
        query=f"Question: {line['question']}\nAnswer:",
        choices=[f" {c}" for c in line["choices"]["text"]],
        gold_index=line["choices"]["label"].index(line["answerKey"]),
    )


def accuracy_pair(doc: Doc, model_response: ModelResponse) -> dict:
    """Raw and per-character accuracy from one pass over the choices."""
    logprobs = np.array(model_response.logprobs[: len(doc.choices)])
    chars = np.array([len(c.removeprefix(" ")) for c in doc.choices])
    return {
        "acc_raw": int(np.argmax(logprobs) == doc.gold_index),
        "acc_per_char": int(np.argmax(logprobs / chars) == doc.gold_index),
    }


def gold_logprob(doc: Doc, model_response: ModelResponse) -> float:
    return model_response.logprobs[doc.gold_index]


accuracy_pair_metric = SampleLevelMetricGrouping(
    metric_name=["acc_raw", "acc_per_char"],
    higher_is_better={"acc_raw": True, "acc_per_char": True},
    category=SamplingMethod.LOGPROBS,
    sample_level_fn=accuracy_pair,
    corpus_level_fn={"acc_raw": np.mean, "acc_per_char": np.mean},
)

gold_logprob_metric = SampleLevelMetric(
    metric_name="gold_logprob",
    higher_is_better=True,
    category=SamplingMethod.LOGPROBS,
    sample_level_fn=gold_logprob,
    corpus_level_fn=np.mean,
)

TASKS_TABLE = [
    LightevalTaskConfig(
        name="arc_grouped",
        prompt_function=arc_prompt,
        hf_repo="allenai/ai2_arc",
        hf_subset="ARC-Easy",
        evaluation_splits=["validation"],
        metrics=[accuracy_pair_metric, gold_logprob_metric, Metrics.loglikelihood_acc],
    )
]

TASKS_GROUPS = {
    "arc-signal": "custom|arc_grouped|0,lighteval|arc:easy|0",
    "everything": "arc-signal,demo|arithmetic|0",
}
