"""What every backend returns for one document, whatever the model framework."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

REASONING_BLOCK = re.compile(r"<think>.*?</think>", flags=re.DOTALL)


@dataclass
class ModelResponse:
    """The model's answer to all requests of one `Doc`.

    Loglikelihood tasks fill `logprobs` and `argmax_logits_eq_gold` with one entry per choice (summed log-prob of
    the choice's tokens, and whether greedy decoding would have produced exactly those tokens); PMI metrics also
    read `unconditioned_logprobs`. Generative tasks fill `text` (one string per sample). Rolling perplexity tasks
    put the document's total log-prob in `logprobs[0]`.
    """

    input: str | list | None = None
    input_tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    output_tokens: list[list[int]] = field(default_factory=list)
    text_post_processed: list[str] | None = None
    reasonings: list[str | None] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    argmax_logits_eq_gold: list[bool] = field(default_factory=list)
    logits: list[list[float]] | None = None
    unconditioned_logprobs: list[float] | None = None
    truncated_tokens_count: int = 0
    padded_tokens_count: int = 0
    continuation_token_counts: list[int] = field(default_factory=list)  # tokens per choice, for acc_norm_token

    @property
    def final_text(self) -> list[str]:
        return self.text_post_processed if self.text_post_processed is not None else self.text

    def post_process(self) -> ModelResponse:
        """Split `<think>...</think>` reasoning blocks off the generated text (kept in `reasonings`)."""
        cleaned, reasonings = [], []
        for t in self.text:
            blocks = REASONING_BLOCK.findall(t)
            reasonings.append("".join(blocks) if blocks else None)
            cleaned.append(REASONING_BLOCK.sub("", t).strip() if blocks else t)
        self.text_post_processed = cleaned
        self.reasonings = reasonings
        return self
