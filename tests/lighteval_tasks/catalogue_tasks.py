"""A lighteval custom task file using lighteval's metric catalogue, written for nano_eval's tests in lighteval's style.

Only the imports differ from a lighteval file; in lighteval they read:
    from lighteval.metrics.metrics import Metrics
    from lighteval.tasks.lighteval_task import LightevalTaskConfig
    from lighteval.tasks.requests import Doc
    from lighteval.tasks.tasks.truthfulqa import truthful_qa_multiple_choice_prompt
    from lighteval.utils.utils import as_list

One task names a metric nano_eval cannot compute (BERTScore): the file still lists every task and the others run.
The data lives in a local mirror the tests write (`hf_repo` "nano-eval-tests/...", read with `data_dir`).
"""

from nano_eval.tasks.lighteval import Doc, LightevalTaskConfig, Metrics, as_list, truthful_qa_multiple_choice_prompt

LABELS = [" negative", " neutral", " positive"]


def sentiment_prompt(line, task_name: str = None):
    return Doc(
        task_name=task_name,
        query=f"Review: {line['text']}\nSentiment:",
        choices=LABELS,
        gold_index=int(line["label"]),
    )


def alias_prompt(line, task_name: str = None):
    """TriviaQA's pattern: one choice holding the list of accepted answers."""
    return Doc(
        task_name=task_name,
        query=f"Question: {line['question']}\nAnswer:",
        choices=[as_list(line["aliases"])],
        gold_index=0,
    )


def translation_prompt(line, task_name: str = None):
    return Doc(
        task_name=task_name,
        query=f"French: {line['fr']}\nEnglish:",
        choices=[line["en"]],
        gold_index=0,
    )


def math_prompt(line, task_name: str = None):
    return Doc(
        task_name=task_name,
        query=f"Problem: {line['problem']}\nAnswer:",
        choices=[line["answer"]],
        gold_index=0,
    )


sentiment = LightevalTaskConfig(
    name="sentiment",
    prompt_function=sentiment_prompt,
    hf_repo="nano-eval-tests/sentiment",
    hf_subset="default",
    hf_avail_splits=["train", "validation"],
    evaluation_splits=["validation"],
    few_shots_split=["train", "validation"],
    few_shots_select="sequential",
    metrics=[
        Metrics.loglikelihood_acc,
        Metrics.mcc,
        Metrics.loglikelihood_f1,
        Metrics.multi_f1_numeric,
        Metrics.mrr,
        Metrics.recall_at_k,
    ],
    version=0,
)

sentiment_bertscore = LightevalTaskConfig(
    name="sentiment:bertscore",
    prompt_function=sentiment_prompt,
    hf_repo="nano-eval-tests/sentiment",
    hf_subset="default",
    evaluation_splits=["validation"],
    metrics=[Metrics.loglikelihood_acc, Metrics.bert_score],
    version=0,
)

aliases = LightevalTaskConfig(
    name="aliases",
    prompt_function=alias_prompt,
    hf_repo="nano-eval-tests/aliases",
    hf_subset="default",
    evaluation_splits=["validation"],
    generation_size=8,
    stop_sequence=["\n"],
    metrics=[Metrics.exact_match, Metrics.quasi_exact_match_triviaqa, Metrics.f1_score, Metrics.rouge1],
    version=0,
)

translation = LightevalTaskConfig(
    name="translation",
    prompt_function=translation_prompt,
    hf_repo="nano-eval-tests/translation",
    hf_subset="default",
    evaluation_splits=["validation"],
    generation_size=8,
    stop_sequence=["\n"],
    metrics=[Metrics.bleu, Metrics.chrf, Metrics.ter, Metrics.bleu_1, Metrics.rougeL, Metrics.f1_score_macro],
    version=0,
)

math = LightevalTaskConfig(
    name="math",
    prompt_function=math_prompt,
    hf_repo="nano-eval-tests/math",
    hf_subset="default",
    evaluation_splits=["validation"],
    generation_size=8,
    stop_sequence=["\n"],
    num_samples=[2],
    metrics=[
        Metrics.expr_gold_metric,
        Metrics.pass_at_k_math(sample_params={"k": 1, "n": 2}),
        Metrics.avg_at_n_math(sample_params={"n": 2}),
    ],
    version=0,
)

truthfulqa = LightevalTaskConfig(
    name="truthfulqa:mc",
    prompt_function=truthful_qa_multiple_choice_prompt,
    hf_repo="nano-eval-tests/truthfulqa",
    hf_subset="default",
    evaluation_splits=["validation"],
    metrics=[Metrics.truthfulqa_mc_metrics],
    version=0,
)

TASKS_TABLE = [sentiment, sentiment_bertscore, aliases, translation, math, truthfulqa]
