"""The scoring core every backend shares: tokenise once, batch, forward, score, gather.

`prepare_*` turn requests into sorted datasets of rows (nano_eval.rows; done once, when an Evaluator is built);
`run_*` push those rows through `backend.forward` and return one result per request key, identical on every rank.
Text becomes tokens by one rule, lm-evaluation-harness's (nano_eval.tokenization), so that scores agree with it.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from tqdm import tqdm

from nano_eval.agreement import Agreement
from nano_eval.backends.base import Backend
from nano_eval.data import DynamicBatchDataset, GenDistributedSampler, GenerativeTaskDataset, LoglikelihoodDataset
from nano_eval.errors import NanoEvalError
from nano_eval.generate import greedy_decode
from nano_eval.lockstep import generation_pools, padded_batch, scoring_schedule
from nano_eval.packing import build_segments, pack_rows, share_prefixes
from nano_eval.parallel import broadcast_from_output_stage, gather_dicts_over_dp
from nano_eval.rows import Choice, Generation, Row, Segment, last_position_row, make_batch, plain_row, split_scores
from nano_eval.scoring import VocabShard, target_logprobs
from nano_eval.tasks.requests import (
    GreedyUntilRequest,
    LoglikelihoodRequest,
    LoglikelihoodRollingRequest,
    LoglikelihoodSingleTokenRequest,
)
from nano_eval.tokenization import Tokenization


@dataclass(frozen=True, kw_only=True)
class BatchingConfig:
    """How rows are grouped into forwards. Scores do not depend on these numbers, only speed and memory do."""

    max_batch_tokens: int = 8192  # padded tokens (rows x longest row) per forward
    max_batch_size: int = 512
    default_generation_size: int = 256  # when a generative task sets no generation_size
    packing: bool = True  # one row per document (context once) on backends with supports_packed_rows
    pack_tokens: int = 256  # also put several short documents in one row, up to this many tokens (0: off)
    shared_prefix_tokens: int = 32  # documents whose contexts share >= this many first tokens share one row (0: off)
    shared_prefix_row_tokens: int = 2048  # longest such row (capped at the model's max length)
    # scoring batches: a row shorter than (1 - max_padding) x the batch's longest starts a new batch, so right padding
    # stays under this share of the positions (rows are sorted by length; every backend computes its padding)
    max_padding: float = 0.25


@dataclass(frozen=True)
class LoglikelihoodResult:
    logprob: float  # summed over the continuation's tokens
    is_greedy: bool  # greedy decoding reproduces the continuation exactly
    num_tokens: int
    truncated: int  # context tokens dropped on the left


class Engine:
    """Scores requests with a backend. Build once per backend; datasets are prepared once and run many times."""

    def __init__(self, backend: Backend, batching: BatchingConfig = BatchingConfig(), progress: bool = True,
                 add_bos_token: bool | None = None):
        self.backend, self.batching, self.layout = backend, batching, backend.layout
        self.progress = progress and self.layout.is_main
        generation_config = getattr(getattr(backend, "module", None), "generation_config", None)
        self.tokens = Tokenization.of(backend.tokenizer, add_bos_token, generation_config)
        tok = backend.tokenizer
        eos = tok.eos_token_id
        self.vocab_size = getattr(backend, "vocab_size", None)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (eos or 0)
        if self.vocab_size and self.pad_id >= self.vocab_size:  # a pad token added to the tokenizer, not the model:
            self.pad_id = eos if eos is not None and eos < self.vocab_size else 0  # padding is masked; any id works
        # the model's forward holds collectives across DP ranks (MoE under expert parallelism): nano_eval.lockstep
        self.lockstep = bool(getattr(backend, "lockstep", False)) and self.layout.dp_size > 1
        # scoring work handed to the model by this rank since the engine was built (count_work): forwards, token
        # positions (rows x columns of every batch), the padding among them, distinct scored positions (the rows
        # the output layer projects)
        self.work: Counter = Counter()

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens) of a loglikelihood request (Tokenization.pair)."""
        return self.tokens.pair(context, continuation)

    def _check_ids(self, tokens: list[int], what: str) -> None:
        """Refuse token ids the model has no embedding row for (an added token, another model's tokenizer): on a GPU
        the lookup would end in a device-side assert that takes the process down, training run included."""
        if self.vocab_size and tokens and max(tokens) >= self.vocab_size:
            raise NanoEvalError(
                f"{what}: token id {max(tokens)} is past the model's {self.vocab_size} embedding rows, so the "
                "tokenizer is not the one the model was trained with (or it has added tokens the model lacks). Fix: "
                "use the model's own tokenizer (--tokenizer on the command line)."
            )

    def _fit(self, key: Any, context: list[int], continuation: list[int], what: str) -> Row:
        """The row scoring `continuation`, its context cut on the left to fit the model's context length."""
        self._check_ids(context + continuation, what)
        limit = self.backend.max_length + 1  # the model sees all tokens but the last
        if len(continuation) >= limit:
            raise NanoEvalError(
                f"{what}: the continuation alone has {len(continuation)} tokens but the model accepts "
                f"{self.backend.max_length}. Fix: raise the model's max length (--max-length) or drop this task."
            )
        truncated = max(0, len(context) + len(continuation) - limit)
        return plain_row(key, context[truncated:], continuation, truncated)

    # ---- preparing ---------------------------------------------------------------------------------------------

    @property
    def packs_rows(self) -> bool:
        """Whether loglikelihood rows may carry tree masks (backend capability, and not switched off)."""
        return self.batching.packing and bool(getattr(self.backend, "supports_packed_rows", False))

    def prepare_loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> LoglikelihoodDataset:
        """A document's requests share one row where the backend allows it (nano_eval.packing); single-token
        choices share one row on every backend; otherwise one plain row per request."""
        groups: dict[tuple, list] = {}
        for r in requests:
            ctx, cont = self.encode_pair(r.context, r.choice)
            r.tokenized_context, r.tokenized_continuation = ctx, cont
            self._fit(r.key, ctx, cont, f"task {r.task_name}, document {r.sample_index}")  # raises if too long
            groups.setdefault((r.task_name, r.sample_index, tuple(ctx)), []).append((r.key, ctx, cont))
        tree, b = self.packs_rows, self.batching
        segments = build_segments(list(groups.values()), self.backend.max_length, tree)
        if not tree:
            return LoglikelihoodDataset(pack_rows(segments, 0))
        rows = []
        if b.shared_prefix_tokens > 0:
            capacity = min(b.shared_prefix_row_tokens, self.backend.max_length)
            rows, segments = share_prefixes(segments, capacity, b.shared_prefix_tokens)
        return LoglikelihoodDataset(rows + pack_rows(segments, b.pack_tokens))

    def prepare_single_token(self, requests: Sequence[LoglikelihoodSingleTokenRequest]) -> LoglikelihoodDataset:
        """One row per context; every choice must be one token and all are scored at the last position (the
        request's result is a list, one entry per choice)."""
        rows = []
        for r in requests:
            ids = []
            for choice in r.choices:
                ctx, cont = self.encode_pair(r.context, choice)
                if len(cont) != 1:
                    raise NanoEvalError(
                        f"task {r.task_name}, document {r.sample_index}: choice {choice!r} is {len(cont)} tokens, "
                        "but single-token requests need one. Fix: use loglikelihood requests for this task."
                    )
                ids.append(cont[0])
            r.tokenized_context, r.tokenized_continuation = ctx, ids
            self._check_ids(ids, f"task {r.task_name}, document {r.sample_index}")
            fitted = self._fit(r.key, ctx, ids[:1], f"task {r.task_name}, document {r.sample_index}").segments[0]
            cut = fitted.choices[0].truncated
            rows.append(Row([Segment(fitted.context, [Choice(r.key, [i], cut, slot=j) for j, i in enumerate(ids)])]))
        return LoglikelihoodDataset(rows)

    def prepare_rolling(self, requests: Sequence[LoglikelihoodRollingRequest]) -> LoglikelihoodDataset:
        """Whole-text log-likelihood in disjoint windows of the model's length (lm-eval's rolling windows)."""
        rows = []
        for r in requests:
            tokens = self.tokens.context(r.context)
            self._check_ids(tokens, f"task {r.task_name}, document {r.sample_index}")
            r.tokenized_context = tokens
            for w, (ctx, cont) in enumerate(rolling_windows(tokens, self.tokens.prefix_id, self.backend.max_length)):
                rows.append(plain_row((r.key, w), ctx, cont))
        return LoglikelihoodDataset(rows)

    def prepare_greedy(self, requests: Sequence[GreedyUntilRequest]) -> GenerativeTaskDataset:
        """One prompt-only row per request, its prompt cut on the left to leave room for the generation."""
        rows = []
        for r in requests:
            max_new = r.generation_size or self.batching.default_generation_size
            room = self.backend.max_length - max_new
            if room < 1:
                raise NanoEvalError(
                    f"task {r.task_name}: generation_size={max_new} leaves no room for a prompt in a model of "
                    f"length {self.backend.max_length}. Fix: lower the task's generation_size."
                )
            tokens = self.tokens.prompt(r.context)
            self._check_ids(tokens, f"task {r.task_name}, document {r.sample_index}")
            r.tokenized_context = tokens
            truncated = max(0, len(tokens) - room)
            generation = Generation(max_new, tuple(r.stop_sequence or ()))
            rows.append(last_position_row(r.key, tokens[truncated:], truncated, generation))
        return GenerativeTaskDataset(rows)

    # ---- running -----------------------------------------------------------------------------------------------

    def _my_batches(self, dataset: DynamicBatchDataset, agreement: Agreement, schedule=None,
                    whole: bool = False, max_padding: float = 1.0) -> list[tuple[list[Row], Any]]:
        """This data-parallel rank's shard of `dataset`, in token-budget batches whose rows are each at least
        (1 - `max_padding`) x the longest (`whole`: cut by generation setting only, the pools of nano_eval.generate).

        Each comes with None, or under lockstep with what `schedule(batches, layout, max_tokens)` agrees for it
        (nano_eval.lockstep: every rank runs the same forwards, each within the budget; a rank without rows for one
        gets `[]`: a dummy batch). A fault while cutting the batches is kept in `agreement` (this rank then has no
        batch but an empty one, or lockstep's dummies, and stops the ranks it meets at their first meeting)."""
        batches = []
        b = self.batching
        cut = (sys.maxsize, sys.maxsize) if whole else (b.max_batch_tokens, b.max_batch_size)
        with agreement.guard():
            shard = list(GenDistributedSampler(dataset, self.layout.dp_size, self.layout.dp_rank))
            batches = [[dataset[i] for i in positions] for positions in
                       dataset.splits_iterator(shard, *cut, max_padding)]
        if agreement.error is not None and not self.lockstep:
            batches = [[]]  # one empty batch: its meeting stops the replica's other ranks at their first
        if self.lockstep:
            return schedule(batches, self.layout, b.max_batch_tokens)
        return [(rows, None) for rows in batches]

    def _vocab_shard(self, logits: torch.Tensor) -> VocabShard:
        lay = self.layout
        return VocabShard.of(logits.shape[-1], lay.tp_rank, lay.tp_group, lay.tp_size)

    def _agreement(self) -> Agreement:
        """A run's fault flag and meeting points (nano_eval.agreement): all ranks under lockstep, else the replica."""
        return Agreement(self.layout, lockstep=self.lockstep)

    def run_loglikelihood(self, dataset: LoglikelihoodDataset, desc: str = "loglikelihood") -> dict:
        """{key: LoglikelihoodResult} (rolling windows keyed (request key, window)); single-token requests give a
        list of results, one per choice. Same dict on every rank.

        A fault outside the forwards on any rank ends the run on every rank before the next forward (or at the end)
        with the same EvaluationFailed (nano_eval.agreement)."""
        local: dict = {}
        slotted: dict = {}  # single-token requests: {key: {slot: result}}
        agreement = self._agreement()
        planned = self._my_batches(dataset, agreement, scoring_schedule, max_padding=self.batching.max_padding)
        for rows, shape in tqdm(planned, desc=desc, disable=not self.progress, leave=False):
            batch = None
            with agreement.guard():
                batch = make_batch(rows, self.pad_id, self.packs_rows) if rows else None
                if shape is not None:  # lockstep: padded to the shape every DP rank runs (or a dummy batch)
                    batch = padded_batch(batch, *shape, self.pad_id)
            if not agreement.meet():  # every rank that runs this forward goes on, or none
                break
            if batch is not None:
                count_work(self.work, batch)
            logits = self.backend.forward(batch)
            if logits is None or not rows:
                continue
            with agreement.guard():
                logprobs, greedy = target_logprobs(logits, batch.targets.to(logits.device), self._vocab_shard(logits))
                for choice, *scores in split_scores(rows, logprobs.tolist(), greedy.tolist()):
                    result = LoglikelihoodResult(*scores, choice.truncated)
                    if choice.slot is None:
                        local[choice.key] = result
                    else:
                        slotted.setdefault(choice.key, {})[choice.slot] = result
        local.update((key, [results[i] for i in sorted(results)]) for key, results in slotted.items())
        agreement.settle()
        return gather_dicts_over_dp(broadcast_from_output_stage(local, self.layout), self.layout)

    def run_greedy(self, dataset: GenerativeTaskDataset, desc: str = "generate") -> dict:
        """{key: GenerationResult}: greedy continuation up to a stop sequence, any EOS id or max_new_tokens.

        One pool per generation setting (nano_eval.generate: continuous batching within --batch-tokens). A fault
        outside the forwards on any rank (detokenising, a stop sequence) ends the run on every rank at the next
        decoding step (or at the end) with the same EvaluationFailed (nano_eval.agreement)."""
        local: dict = {}
        agreement = self._agreement()
        b = self.batching
        pools = self._my_batches(dataset, agreement, generation_pools, whole=True)
        with tqdm(total=sum(len(rows) for rows, _ in pools), desc=desc, disable=not self.progress,
                  leave=False) as bar:
            for rows, _ in pools:
                local.update(greedy_decode(self.backend, rows, self.pad_id, self.tokens.eos_ids, self._vocab_shard,
                                           shared_prefix_tokens=b.shared_prefix_tokens, lockstep=self.lockstep,
                                           agreement=agreement, max_tokens=b.max_batch_tokens,
                                           max_rows=b.max_batch_size, on_done=bar.update))
        agreement.settle()
        return gather_dicts_over_dp(broadcast_from_output_stage(local, self.layout), self.layout)


WORK_COUNTS = ("forwards", "positions", "padding", "output_positions")  # what count_work adds up


def count_work(work: Counter, batch) -> None:
    """Add one forward of `batch` to `work`: its token positions (B x S, what the embedding sees; a backend may
    add sequence-parallel padding), the padding among them, and its distinct scored positions (single-token choices
    share their context's last one; every backend projects each through the output layer once)."""
    rows, columns = batch.input_ids.shape
    work["forwards"] += 1
    work["positions"] += rows * columns
    work["padding"] += rows * columns - int(batch.attention_mask.sum())
    work["output_positions"] += len(set(zip(batch.rows.tolist(), batch.cols.tolist())))


def rolling_windows(tokens: list[int], prefix_id: int, max_len: int) -> Iterator[tuple[list[int], list[int]]]:
    """Split `tokens` into (context, continuation) pairs that score every token exactly once.

    The first window is conditioned on `prefix_id`; each later window predicts up to `max_len` new tokens with
    the preceding tokens as context, so every row has at most max_len + 1 tokens.
    """
    if not tokens:
        return
    first = min(max_len, len(tokens))
    yield [prefix_id], tokens[:first]
    done = first
    while done < len(tokens):
        n_pred = min(len(tokens) - done, max_len)
        end = done + n_pred
        yield tokens[end - max_len - 1 : done], tokens[done:end]
        done = end
