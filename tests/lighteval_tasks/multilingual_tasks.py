"""A lighteval multilingual task file (templates, formulations, Language, language-aware metrics), written for
nano_eval's tests in the style of lighteval's `tasks/multilingual/tasks/*.py`.

Only the imports differ from a lighteval file; in lighteval they read:
    from lighteval.metrics.dynamic_metrics import (LogLikelihoodAccMetric, MultilingualQuasiExactMatchMetric,
                                                   MultilingualQuasiF1ScoreMetric)
    from lighteval.metrics.normalizations import LogProbCharNorm, LogProbTokenNorm
    from lighteval.tasks.default_prompts import LETTER_INDICES
    from lighteval.tasks.lighteval_task import LightevalTaskConfig
    from lighteval.tasks.multilingual.utils.task_utils import get_metrics_for_formulation, normalize_subset
    from lighteval.tasks.templates.boolq import get_boolq_prompt_function
    from lighteval.tasks.templates.continuation import get_continuation_prompt_function
    from lighteval.tasks.templates.copa import get_copa_prompt_function
    from lighteval.tasks.templates.hellaswag import get_hellaswag_prompt_function
    from lighteval.tasks.templates.multichoice import get_mcq_prompt_function
    from lighteval.tasks.templates.nli import get_nli_prompt_function
    from lighteval.tasks.templates.qa import get_qa_prompt_function
    from lighteval.tasks.templates.utils.formulation import CFFormulation, HybridFormulation, MCFFormulation
    from lighteval.utils.imports import is_package_available
    from lighteval.utils.language import Language

The Yoruba tasks has no prompt words in nano_eval: it lists, and refuses to run when selected.
"""

from nano_eval.tasks.lighteval import (LETTER_INDICES, CFFormulation, HybridFormulation, Language, LightevalTaskConfig,
                                       LogLikelihoodAccMetric, LogProbCharNorm, LogProbTokenNorm, MCFFormulation,
                                       MultilingualQuasiExactMatchMetric, MultilingualQuasiF1ScoreMetric,
                                       get_boolq_prompt_function, get_continuation_prompt_function,
                                       get_copa_prompt_function, get_hellaswag_prompt_function,
                                       get_mcq_prompt_function, get_metrics_for_formulation, get_nli_prompt_function,
                                       get_qa_prompt_function, is_package_available, normalize_subset)

assert is_package_available("numpy")

CHOICE_METRICS = [
    LogLikelihoodAccMetric(normalization=LogProbTokenNorm()),
    LogLikelihoodAccMetric(normalization=LogProbCharNorm()),
]

mcq_tasks = [
    LightevalTaskConfig(
        name=f"quiz_{language.value}_{formulation.name.lower()}:{normalize_subset('General Knowledge')}",
        prompt_function=get_mcq_prompt_function(
            language,
            lambda line: {
                "question": line["question"],
                "choices": line["options"],
                "gold_idx": LETTER_INDICES.index(line["answer"]),
            },
            formulation=formulation,
        ),
        hf_repo="nano-eval-tests/quiz",
        hf_subset="default",
        evaluation_splits=("test",),
        few_shots_split="dev",
        metrics=get_metrics_for_formulation(formulation, CHOICE_METRICS),
    )
    for language in [Language.FRENCH, Language.ENGLISH, Language.YORUBA]
    for formulation in [MCFFormulation(), CFFormulation(), HybridFormulation()]
]

qa_task = LightevalTaskConfig(
    name=f"capitals_{Language.FRENCH.value}",
    prompt_function=get_qa_prompt_function(
        Language.FRENCH,
        lambda line: {"question": line["question"], "choices": line["answers"], "context": line["context"]},
    ),
    hf_repo="nano-eval-tests/capitals",
    hf_subset="default",
    evaluation_splits=("validation",),
    generation_size=8,
    stop_sequence=["\n"],
    metrics=[
        MultilingualQuasiExactMatchMetric(Language.FRENCH, "prefix"),
        MultilingualQuasiF1ScoreMetric(Language.FRENCH),
    ],
)

cloze_tasks = [
    LightevalTaskConfig(
        name="yesno_eng_cf",
        prompt_function=get_boolq_prompt_function(
            Language.ENGLISH,
            lambda line: {"question": line["question"], "answer": line["answer"], "context": line["passage"]},
            formulation=CFFormulation(),
        ),
        hf_repo="nano-eval-tests/yesno",
        hf_subset="default",
        evaluation_splits=("validation",),
        metrics=[LogLikelihoodAccMetric(normalization=None)],
    ),
    LightevalTaskConfig(
        name="copa_eng_cf",
        prompt_function=get_copa_prompt_function(
            Language.ENGLISH,
            {"context": "premise", "cause_effect": "question", "continuations": "choices", "gold_idx": "label"},
            formulation=CFFormulation(),
        ),
        hf_repo="nano-eval-tests/copa",
        hf_subset="default",
        evaluation_splits=("validation",),
        metrics=[LogLikelihoodAccMetric(normalization=LogProbCharNorm())],
    ),
    LightevalTaskConfig(
        name="nli_eng_hybrid",
        prompt_function=get_nli_prompt_function(
            Language.ENGLISH,
            {"premise": "premise", "hypothesis": "hypothesis", "gold_idx": "label"},
            relations=["entailment", "neutral", "contradiction"],
            formulation=HybridFormulation(),
        ),
        hf_repo="nano-eval-tests/nli",
        hf_subset="default",
        evaluation_splits=("validation",),
        metrics=[LogLikelihoodAccMetric(normalization=None)],
    ),
    LightevalTaskConfig(
        name="story_eng_cf",
        prompt_function=get_continuation_prompt_function(
            Language.ENGLISH,
            {"context": "story", "continuations": "endings", "gold_idx": "label"},
            formulation=CFFormulation(),
        ),
        hf_repo="nano-eval-tests/story",
        hf_subset="default",
        evaluation_splits=("validation",),
        metrics=[LogLikelihoodAccMetric(normalization=LogProbCharNorm())],
    ),
    LightevalTaskConfig(
        name="hellaswag_eng_mcf",
        prompt_function=get_hellaswag_prompt_function(
            Language.ENGLISH,
            {"ctx_a": "ctx_a", "ctx_b": "ctx_b", "activity_label": "activity_label", "continuations": "endings",
             "gold_idx": "label"},
            formulation=MCFFormulation(),
        ),
        hf_repo="nano-eval-tests/story_hs",
        hf_subset="default",
        evaluation_splits=("validation",),
        metrics=[LogLikelihoodAccMetric(normalization=None)],
    ),
]

TASKS_TABLE = [*mcq_tasks, qa_task, *cloze_tasks]
