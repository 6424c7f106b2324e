"""No number from a broken model: a NaN or infinite log-prob, or a generation decoded from NaN / inf logits, ends the
task's scoring with a NonFiniteScoreError naming the task and the document, instead of a score.

A checkpoint whose config or weights make the model output NaN (`rope_theta: 0`, a NaN weight, a diverged run)
otherwise scores quietly: NaN compares false, so every choice "loses" and the task reads as accuracy 0.0. The check
runs on each document's assembled response (nano_eval.evaluator), after the results were gathered over the
data-parallel ranks, so every rank sees the same numbers and fails the same task: no rank is left in a collective.
"""

from __future__ import annotations

import math

from nano_eval.errors import NonFiniteScoreError
from nano_eval.generate import GenerationResult
from nano_eval.response import ModelResponse

FIX = ("the checkpoint's weights or config give non-finite logits, so this task has no score. Fix: check the config "
       "against the training run's (rope_theta, rms_norm_eps, ...) and the weights for NaN / inf (a diverged run), "
       "or evaluate an earlier checkpoint")


def check_finite(task: str, doc_index: int, response: ModelResponse, generation: GenerationResult | None = None,
                 rolling: bool = False) -> None:
    """Raise NonFiniteScoreError if the document's log-probs (per choice, unconditioned ones too; a rolling task's
    total) are not finite, or if its generation met non-finite logits."""
    where = f"task {task}, document {doc_index}"
    for what, values in (("choice", response.logprobs), ("unconditioned choice", response.unconditioned_logprobs)):
        for j, value in enumerate(values or ()):
            if not math.isfinite(value):
                subject = "the text's log-probability" if rolling else f"the log-probability of {what} {j}"
                raise NonFiniteScoreError(f"{where}: {subject} is {value}: {FIX}.", task=task)
    if generation is not None and generation.non_finite_at is not None:
        raise NonFiniteScoreError(f"{where}: the logits were NaN or infinite at generated token "
                                  f"{generation.non_finite_at}: {FIX}.", task=task)
