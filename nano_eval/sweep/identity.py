"""What makes two evaluations of a checkpoint the same: used to skip checkpoints a previous sweep already scored.

evaluation identity = hash(task keys in order, task versions, max_samples, seed, add_bos_token, use_chat_template,
system_prompt, dtype, max_length, tokenizer, results schema version, checkpoint fingerprint). Batch sizes and world size are left out: they never change scores.
"""

from __future__ import annotations

import hashlib
import json

from nano_eval.job import EvalJob
from nano_eval.tracking.files import SCHEMA_VERSION


def identity_settings(job: EvalJob, task_keys: list[str], task_versions: dict[str, int]) -> dict:
    """The settings part of the evaluation identity: the same for every checkpoint of one sweep."""
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
    }


def evaluation_identity(job: EvalJob, task_keys: list[str], task_versions: dict[str, int],
                        checkpoint_fingerprint: str) -> str:
    """Hex digest of everything that decides a checkpoint's scores (see the module docstring); the checkpoint
    fingerprint is nano_eval.checkpoints.load.fingerprint."""
    parts = {**identity_settings(job, task_keys, task_versions), "checkpoint": checkpoint_fingerprint}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def settings_differences(ours: dict, theirs: dict) -> list[str]:
    """`name: ours here, theirs there` for every setting that differs (keys missing on one side included)."""
    return [f"{k}: {ours.get(k)!r} here, {theirs.get(k)!r} there" for k in sorted(set(ours) | set(theirs))
            if ours.get(k) != theirs.get(k)]
