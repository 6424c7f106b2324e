"""What makes two evaluations of a checkpoint the same: used to skip checkpoints a previous sweep already scored.

evaluation identity = hash(task keys in order, task versions, max_samples, seed, add_bos_token, use_chat_template,
system_prompt, dtype, max_length, tokenizer, results schema version, checkpoint fingerprint), plus, with
--lm-eval-include-path, the folder and a fingerprint of the lm-eval task files in it (`lm_eval_sources`: a task
version is whatever the user's YAML says, so editing a YAML or its `!function` Python must not reuse results of the
old one), plus, when not lm-eval's default, the bootstrap iterations of lm_eval|... stderrs. Settings are added only
when set, so the identities of sweeps without them stay what they were. Batch sizes and world size are left out:
they never change scores.
"""

from __future__ import annotations

import hashlib
import json
import os

from nano_eval.job import EvalJob
from nano_eval.tracking.files import SCHEMA_VERSION


def lm_eval_task_file(name: str) -> bool:
    """A file lm-eval reads as task definition from an include path: YAMLs (`*.yaml`, `*.yml`, and included
    templates such as `_default_template_yaml`) and the Python of their `!function` hooks."""
    return name.endswith(("yaml", ".yml", ".py"))


def lm_eval_sources(include_path: str | None) -> dict:
    """{} without an include path; else {"lm_eval_include_path": the real folder, "lm_eval_include_fingerprint": a
    digest of its task files (nano_eval.local_files.folder_fingerprint; data files they point to are not read, as
    --data-dir is not)}. A sweep computes it once, when it loads its tasks."""
    if not include_path:
        return {}
    from nano_eval.local_files import folder_fingerprint

    real = os.path.realpath(os.path.expanduser(include_path))
    digest = folder_fingerprint(real, lm_eval_task_file, fix="keep only real task files (YAMLs and their Python) in "
                                "--lm-eval-include-path, or replace a link by what it points to")
    return {"lm_eval_include_path": real, "lm_eval_include_fingerprint": digest}


def identity_settings(job: EvalJob, task_keys: list[str], task_versions: dict[str, int],
                      sources: dict | None = None) -> dict:
    """The settings part of the evaluation identity: the same for every checkpoint of one sweep. `sources`:
    `lm_eval_sources(job.lm_eval_include_path)` as computed when the tasks loaded (computed now if not given)."""
    if sources is None:
        sources = lm_eval_sources(job.lm_eval_include_path)
    return {
        "tasks": list(task_keys),
        "task_versions": dict(sorted(task_versions.items())),
        "max_samples": job.eval.max_samples,
        "seed": job.eval.seed,
        "add_bos_token": job.eval.add_bos_token,
        "use_chat_template": job.eval.use_chat_template,
        "system_prompt": job.eval.system_prompt,
        "dtype": job.load.dtype,
        "max_length": job.load.max_length,
        "tokenizer": job.load.tokenizer,
        "schema_version": SCHEMA_VERSION,
        **sources,
        **_bootstrap(job, task_keys),
    }


def _bootstrap(job: EvalJob, task_keys: list[str]) -> dict:
    """{"lm_eval_bootstrap_iters": n} when lm_eval|... tasks have their stderrs bootstrapped n times, n not lm-eval's
    default; else {}."""
    from nano_eval.tasks.lm_eval_tasks import BOOTSTRAP_ITERS, SUITE

    iters = job.eval.lm_eval_bootstrap_iters
    if iters is None or iters == BOOTSTRAP_ITERS or not any(k.startswith(f"{SUITE}|") for k in task_keys):
        return {}
    return {"lm_eval_bootstrap_iters": iters}


def evaluation_identity(job: EvalJob, task_keys: list[str], task_versions: dict[str, int],
                        checkpoint_fingerprint: str, sources: dict | None = None) -> str:
    """Hex digest of everything that decides a checkpoint's scores (see the module docstring); the checkpoint
    fingerprint is nano_eval.checkpoints.load.fingerprint, `sources` as for identity_settings."""
    parts = {**identity_settings(job, task_keys, task_versions, sources), "checkpoint": checkpoint_fingerprint}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def settings_differences(ours: dict, theirs: dict) -> list[str]:
    """`name: ours here, theirs there` for every setting that differs (keys missing on one side included)."""
    return [f"{k}: {ours.get(k)!r} here, {theirs.get(k)!r} there" for k in sorted(set(ours) | set(theirs))
            if ours.get(k) != theirs.get(k)]
