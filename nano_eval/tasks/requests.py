"""Documents and the requests a task asks the model to answer.

A `Doc` is one benchmark item after the task's prompt function ran on a dataset row. A task turns each `Doc`
into one or more requests; a backend answers each request; metrics then read the answers per `Doc`.
Field names follow lighteval so that its prompt functions and task configs work unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Doc:
    """One evaluation item, with lighteval's fields in lighteval's order (its prompt functions build it unchanged).

    `query` is the prompt (few-shot examples are added later by the PromptManager), `choices` the candidate
    continuations (or the reference answers for generative tasks) and `gold_index` the correct one(s).
    `instruction` (None or "" for none) is printed once at the top of a few-shot context. The generation fields
    after `fewshot_sorting_class` exist so lighteval prompt functions can set them; nano_eval reads the task
    config's `generation_size` / `stop_sequence` instead. `images` is rejected when the task loads.
    """

    query: str
    choices: list[str] = field(default_factory=list)
    gold_index: int | list[int] = 0
    instruction: str | None = ""
    images: list | None = None
    specific: dict[str, Any] | None = None
    unconditioned_query: str | None = None  # query for PMI normalisation (acc_norm_pmi)
    original_query: str | None = None
    id: str = ""
    task_name: str = ""
    fewshot_samples: list = field(default_factory=list)
    sampling_methods: list = field(default_factory=list)
    fewshot_sorting_class: str | None = None  # class used by the "balanced" few-shot selection
    generation_size: int | None = None
    stop_sequences: list[str] | None = None
    use_logits: bool = False
    num_samples: int = 1
    generation_grammar: Any = None

    def gold_indices(self) -> list[int]:
        return list(self.gold_index) if isinstance(self.gold_index, (list, tuple)) else [self.gold_index]

    def golds(self) -> list[str]:
        """The gold choices; a choice that is itself a list (several accepted answers, e.g. TriviaQA's aliases)
        contributes each of its items, as in lighteval."""
        out: list[str] = []
        for i in self.gold_indices():
            choice = self.choices[i]
            out += list(choice) if isinstance(choice, (list, tuple)) else [choice]
        return out

    def get_golds(self) -> list[str]:
        """lighteval's name for `golds()`."""
        return self.golds()


class RequestType(enum.Enum):
    LOGLIKELIHOOD = "loglikelihood"
    LOGLIKELIHOOD_SINGLE_TOKEN = "loglikelihood_single_token"
    LOGLIKELIHOOD_ROLLING = "loglikelihood_rolling"
    GREEDY_UNTIL = "greedy_until"
    GREEDY_UNTIL_MULTI_TURN = "greedy_until_multi_turn"


class SamplingMethod(str, enum.Enum):
    """lighteval's metric categories; `request_type` is the nano_eval request that answers each."""

    GENERATIVE = "GENERATIVE"
    LOGPROBS = "LOGPROBS"  # log-probs of the choices
    PERPLEXITY = "PERPLEXITY"  # log-prob of the whole query

    @property
    def request_type(self) -> RequestType:
        return {
            SamplingMethod.GENERATIVE: RequestType.GREEDY_UNTIL,
            SamplingMethod.LOGPROBS: RequestType.LOGLIKELIHOOD,
            SamplingMethod.PERPLEXITY: RequestType.LOGLIKELIHOOD_ROLLING,
        }[self]


@dataclass
class Request:
    """Base of all requests: which task, which document, which request of that document, and the prompt."""

    task_name: str
    sample_index: int
    request_index: int
    context: str
    metric_categories: list[str] = field(default_factory=list)

    request_type = None  # set by subclasses

    @property
    def key(self) -> tuple[str, int, int]:
        """Unique id of the request inside one evaluation; results are matched back by it."""
        return (self.task_name, self.sample_index, self.request_index)


@dataclass
class LoglikelihoodRequest(Request):
    """log P(choice | context). Token ids are filled in once by the tokenising step."""

    choice: str = ""
    tokenized_context: list[int] | None = None
    tokenized_continuation: list[int] | None = None
    request_type = RequestType.LOGLIKELIHOOD


@dataclass
class LoglikelihoodSingleTokenRequest(Request):
    """log P(c | context) for several single-token choices c, answered by one forward."""

    choices: list[str] = field(default_factory=list)
    tokenized_context: list[int] | None = None
    tokenized_continuation: list[int] | None = None  # one token id per choice
    request_type = RequestType.LOGLIKELIHOOD_SINGLE_TOKEN


@dataclass
class LoglikelihoodRollingRequest(Request):
    """log P(context) of a whole text, scored in windows of the model's context length."""

    tokenized_context: list[int] | None = None
    request_type = RequestType.LOGLIKELIHOOD_ROLLING


@dataclass
class GreedyUntilRequest(Request):
    """Generate greedily from `context` until a stop sequence or `generation_size` new tokens."""

    stop_sequence: list[str] = field(default_factory=list)
    generation_size: int | None = None
    generation_grammar: Any = None
    tokenized_context: list[int] | None = None
    num_samples: int = 1
    do_sample: bool = False
    use_logits: bool = False
    request_type = RequestType.GREEDY_UNTIL


@dataclass
class GreedyUntilMultiTurnRequest(Request):
    """A conversation: `context` holds the turns; each turn is answered greedily (not supported by base LMs)."""

    stop_sequence: list[str] = field(default_factory=list)
    generation_size: int | None = None
    use_logits: bool = False
    request_type = RequestType.GREEDY_UNTIL_MULTI_TURN
