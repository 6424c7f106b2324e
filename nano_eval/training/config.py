"""What the in-training evaluation hook evaluates, when, and where its results go (see nano_eval/training/hook.py)."""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from nano_eval.engine import BatchingConfig
from nano_eval.errors import NanoEvalError

SECTION = "nano_eval"  # the trainers' YAML section (nanotron) / file (torchtitan's --nano-eval) of hook options
ALIASES = {"interval": "every_n_steps", "samples": "max_samples"}


@dataclass(frozen=True, kw_only=True)
class EvalHookConfig:
    """What to evaluate, when, and where results go. Scores never depend on batch_tokens / max_batch_size."""

    tasks: str  # "suite|task|k,suite|task|k" or a file with one spec per line
    every_n_steps: int | None = None  # evaluate at steps N, 2N, ... (never at step 0 unless listed below)
    also_at_steps: tuple[int, ...] = ()  # extra steps, e.g. (1,) for an early sanity check
    max_samples: int | None = None  # first K documents of each task (dataset order): the same for every layout
    # Per-task caps that override max_samples, keyed by "suite|task|k", "suite|task" or the task name,
    # e.g. {"lighteval|hellaswag": 1000, "gsm8k": 100}: cheap tasks in full, expensive ones sampled.
    max_samples_per_task: Mapping[str, int] | None = None
    # Soft wall-clock budget per evaluation, checked between tasks: once it is spent, the remaining tasks are
    # skipped (all ranks agree; results name them) and the next evaluation starts with the first skipped task.
    # A task that has started always finishes, so every scored task scores the same documents on every layout.
    time_budget_s: float | None = None
    batch_tokens: int = BatchingConfig.max_batch_tokens
    max_batch_size: int = BatchingConfig.max_batch_size
    output_dir: str | os.PathLike = "nano_eval_results"
    custom_tasks: str | None = None  # Python file defining TASKS_TABLE
    data_dir: str | None = None  # offline data mirror
    lm_eval_include_path: str | None = None  # folder of your own lm-eval task YAMLs (for lm_eval|... specs)
    # Bootstrap resamples for the stderrs of lm_eval|... metrics that lm-eval bootstraps (mcc, f1, perplexity,
    # median; bleu/chrf/ter take at most 100 anyway). lm-eval's default, 100000, costs minutes per such metric at
    # every evaluation (an mcc over 100 documents: 2-5 ms a resample); 100, lm-eval's own cap for its costliest
    # metrics, costs a fraction of a second and gives the stderr to ~7% (1000: ~2%, seconds). 0: no stderrs at all
    # (the analytic ones of means too, as lm-eval's bootstrap_iters=0); None: lm-eval's 100000. Metrics themselves
    # never change.
    lm_eval_bootstrap_iters: int | None = 100
    seed: int = 0  # few-shot sampling seed
    add_bos_token: bool | None = None  # BOS before contexts; None: the tokenizer's own choice (as lm-eval)
    use_chat_template: bool = False  # contexts through the tokenizer's chat template (instruct models)
    system_prompt: str | None = None  # first in every context (the system turn with a chat template)
    fail_soft: bool = True  # True: a failed evaluation is reported and training goes on; False: every rank raises
    # The global rank that writes the files and logs to W&B/TensorBoard (results are the same on every rank).
    # Set it to the rank that holds the trainer's W&B run: nanotron logs from the first rank of the last PP stage.
    publish_rank: int = 0
    write_details: bool = False  # per-sample details under step_<N>/details/
    progress: bool = False
    # W&B. wandb=None: log into the trainer's wandb.run if one is open, else open a run only if wandb_project is set.
    wandb: bool | None = None
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_run_name: str | None = None
    wandb_mode: str | None = None  # "online" / "offline" / "disabled"; None: WANDB_MODE or W&B's default
    wandb_dir: str | None = None  # where W&B writes its run folder; default: output_dir
    wandb_init_kwargs: Mapping[str, Any] | None = None  # anything else for wandb.init
    step_key: str = "train/step"  # W&B x-axis of every eval metric
    # Also pass the trainer's step as W&B's own step (`log(row, step=step)`), for trainers that log every row with
    # step= themselves (Megatron-LM: `wandb_writer.log(..., iteration)`): a row without it would move W&B's step
    # past the trainer's, and the trainer's next row at the same step would be dropped.
    wandb_log_step: bool = False
    tokens_key: str = "train/consumed_tokens"
    metric_prefix: str = "eval"
    log_stderr: bool = False  # also send "<metric>_stderr" to W&B/TensorBoard (always in the local files)
    tensorboard_dir: str | None = None  # write TensorBoard scalars here (needs the tensorboard package)

    def __post_init__(self):
        object.__setattr__(self, "also_at_steps", tuple(int(s) for s in self.also_at_steps))
        if self.every_n_steps is not None and self.every_n_steps <= 0:
            raise ValueError(f"every_n_steps must be a positive integer or None, got {self.every_n_steps}")
        if self.time_budget_s is not None and self.time_budget_s < 0:
            raise ValueError(f"time_budget_s must be >= 0 or None, got {self.time_budget_s}")
        if self.max_samples is not None and self.max_samples <= 0:
            raise ValueError(f"max_samples must be positive or None, got {self.max_samples}")
        for key, cap in (self.max_samples_per_task or {}).items():
            if not isinstance(cap, int) or cap <= 0:
                raise ValueError(f"max_samples_per_task[{key!r}] must be a positive integer, got {cap!r}")
        if self.add_bos_token is not None and not isinstance(self.add_bos_token, bool):
            raise ValueError(f"add_bos_token must be true, false or unset, got {self.add_bos_token!r}")
        if not isinstance(self.use_chat_template, bool):
            raise ValueError(f"use_chat_template must be true or false, got {self.use_chat_template!r}")
        if self.system_prompt is not None and not isinstance(self.system_prompt, str):
            raise ValueError(f"system_prompt must be a string or unset, got {self.system_prompt!r}")
        iters = self.lm_eval_bootstrap_iters
        if iters is not None and (isinstance(iters, bool) or not isinstance(iters, int) or iters < 0):
            raise ValueError(f"lm_eval_bootstrap_iters must be an integer >= 0 (0: no stderrs) or None, got {iters!r}")
        if self.publish_rank < 0:
            raise ValueError(f"publish_rank must be a global rank >= 0, got {self.publish_rank}")


def sample_caps(specs: list, default: int | None, per_task: Mapping[str, int] | None) -> list[int | None]:
    """The document cap of each task: the most specific key of `per_task` that names it, else `default`.
    A key that names no task is an error (a typo must not silently evaluate a task in full)."""
    per_task = dict(per_task or {})
    caps, used = [], set()
    for spec in specs:
        names = (spec.key, spec.full_name, spec.task)
        key = next((k for k in names if k in per_task), None)
        used.add(key)
        caps.append(per_task[key] if key is not None else default)
    unknown = sorted(set(per_task) - used)
    if unknown:
        known = ", ".join(s.key for s in specs)
        raise ValueError(f"max_samples_per_task names no evaluated task: {', '.join(unknown)} (tasks: {known})")
    return caps


def parse_hook_section(section: Mapping[str, Any] | None, source: str, *, defaults: Mapping[str, Any],
                       fixed: tuple[str, ...] = (), extra_keys: set[str] = frozenset()
                       ) -> tuple[EvalHookConfig, dict[str, Any]] | None:
    """A `nano_eval:` mapping (a trainer's YAML) -> (EvalHookConfig, {extra key: value}); None when it is absent or
    says `enabled: false`. `defaults` are the trainer's own (its W&B keys), `fixed` the hook keys the trainer sets
    itself (not accepted here), `extra_keys` the trainer integration's own options.

    Errors name the file, the key and the fix (a typo in a key must not silently turn evaluation off)."""
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise NanoEvalError(f"{source}: `{SECTION}:` must be a mapping of options, got {type(section).__name__}")
    hook_keys = {f.name for f in fields(EvalHookConfig)} - set(fixed)
    allowed = hook_keys | set(extra_keys) | {"enabled"}
    values = {ALIASES.get(k, k): v for k, v in section.items()}
    unknown = sorted(set(values) - allowed, key=str)
    if unknown:
        known = sorted(allowed | set(ALIASES))
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(str(k), known, n=1)) else str(k)
                 for k in unknown]
        raise NanoEvalError(f"{source}: unknown key(s) in `{SECTION}:`: {', '.join(hints)}. Known keys: {', '.join(known)}")
    if values.pop("enabled", True) is False:
        return None
    if not values.get("tasks"):
        raise NanoEvalError(f"{source}: `{SECTION}:` needs `tasks:` (e.g. \"lighteval|hellaswag|0\"), or `enabled: false`")
    if isinstance(values["tasks"], (list, tuple)):
        values["tasks"] = ",".join(values["tasks"])
    extra = {k: values.pop(k) for k in list(values) if k in extra_keys}
    try:
        return EvalHookConfig(**{**defaults, **values}), extra
    except (TypeError, ValueError) as e:
        raise NanoEvalError(f"{source}: bad `{SECTION}:` section: {e}") from e
