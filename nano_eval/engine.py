"""The scoring core every backend shares: tokenise once, batch, forward, score, gather.

`prepare_*` turn requests into sorted datasets of token rows (done once, when an Evaluator is built);
`run_*` push those rows through `backend.forward` and return one result per request key, identical on every rank.
Tokenisation follows lm-evaluation-harness exactly so that scores agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from tqdm import tqdm

from nano_eval.data import (
    DynamicBatchDataset,
    GenDistributedSampler,
    GenerativeTaskDataset,
    LoglikelihoodDataset,
    ScoringItem,
)
from nano_eval.errors import NanoEvalError
from nano_eval.models.base import Backend, Batch
from nano_eval.packing import PackedRow, build_segments, make_packed_batch, pack_rows, share_prefixes, split_packed
from nano_eval.parallel import broadcast_from_output_stage, broadcast_tensor_from_output_stage, gather_dicts_over_dp
from nano_eval.requests import (
    GreedyUntilRequest,
    LoglikelihoodRequest,
    LoglikelihoodRollingRequest,
    LoglikelihoodSingleTokenRequest,
)
from nano_eval.scoring import VocabShard, argmax_tokens, target_logprobs


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


@dataclass(frozen=True)
class LoglikelihoodResult:
    logprob: float  # summed over the continuation's tokens
    is_greedy: bool  # greedy decoding reproduces the continuation exactly
    num_tokens: int
    truncated: int  # context tokens dropped on the left


@dataclass(frozen=True)
class GenerationResult:
    text: str
    tokens: list[int]
    input_tokens: list[int]
    truncated: int


class Engine:
    """Scores requests with a backend. Build once per backend; datasets are prepared once and run many times."""

    def __init__(self, backend: Backend, batching: BatchingConfig = BatchingConfig(), progress: bool = True):
        self.backend, self.batching, self.layout = backend, batching, backend.layout
        self.progress = progress and self.layout.is_main
        tok = backend.tokenizer
        self.eos_id = tok.eos_token_id
        self.prefix_id = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else (self.eos_id or 0)

    # ---- tokenising --------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.backend.tokenizer.encode(text)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokens of context and continuation as lm-eval splits them: trailing context spaces move to the
        continuation, and the continuation is whatever the joint encoding adds after the context."""
        if not context:
            return [self.prefix_id], self.encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.encode(context + continuation), self.encode(context)
        return ctx, whole[len(ctx) :]

    def _fit(self, key: Any, context: list[int], continuation: list[int], what: str) -> ScoringItem:
        """One row scoring `continuation`, its context cut on the left to fit the model's context length."""
        limit = self.backend.max_length + 1  # the model sees all tokens but the last
        if len(continuation) >= limit:
            raise NanoEvalError(
                f"{what}: the continuation alone has {len(continuation)} tokens but the model accepts "
                f"{self.backend.max_length}. Fix: raise the model's max length (--max-length) or drop this task."
            )
        tokens = context + continuation
        truncated = max(0, len(tokens) - limit)
        return ScoringItem(key=key, tokens=tokens[truncated:], n_scored=len(continuation), truncated=truncated)

    # ---- preparing ---------------------------------------------------------------------------------------------

    @property
    def packs_rows(self) -> bool:
        """Whether loglikelihood rows may carry tree masks (backend capability, and not switched off)."""
        return self.batching.packing and bool(getattr(self.backend, "supports_packed_rows", False))

    def prepare_loglikelihood(self, requests: Sequence[LoglikelihoodRequest]) -> LoglikelihoodDataset:
        """Rows of PackedRow: a document's requests share one row where the backend allows it (nano_eval.packing),
        single-token choices share one row on every backend; otherwise one row per request, as before."""
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
        """One row per context; every choice must be one token and all are scored at the last position."""
        items = []
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
            item = self._fit(r.key, ctx, ids[:1], f"task {r.task_name}, document {r.sample_index}")
            item.extra["choice_ids"] = ids
            items.append(item)
        return LoglikelihoodDataset(items)

    def prepare_rolling(self, requests: Sequence[LoglikelihoodRollingRequest]) -> LoglikelihoodDataset:
        """Whole-text log-likelihood in disjoint windows of the model's length (lm-eval's rolling windows)."""
        items = []
        for r in requests:
            tokens = self.encode(r.context)
            r.tokenized_context = tokens
            for w, (ctx, cont) in enumerate(rolling_windows(tokens, self.prefix_id, self.backend.max_length)):
                items.append(ScoringItem(key=(r.key, w), tokens=ctx + cont, n_scored=len(cont)))
        return LoglikelihoodDataset(items)

    def prepare_greedy(self, requests: Sequence[GreedyUntilRequest]) -> GenerativeTaskDataset:
        items = []
        for r in requests:
            max_new = r.generation_size or self.batching.default_generation_size
            room = self.backend.max_length - max_new
            if room < 1:
                raise NanoEvalError(
                    f"task {r.task_name}: generation_size={max_new} leaves no room for a prompt in a model of "
                    f"length {self.backend.max_length}. Fix: lower the task's generation_size."
                )
            tokens = self.encode(r.context) if r.context else [self.prefix_id]
            r.tokenized_context = tokens
            truncated = max(0, len(tokens) - room)
            group = (max_new, tuple(r.stop_sequence or ()))
            extra = {"max_new_tokens": max_new, "stop": list(r.stop_sequence or ()), "group": group}
            items.append(ScoringItem(key=r.key, tokens=tokens[truncated:], n_scored=0, truncated=truncated, extra=extra))
        return GenerativeTaskDataset(items)

    # ---- running -----------------------------------------------------------------------------------------------

    def _my_batches(self, dataset: DynamicBatchDataset, desc: str) -> Iterator[list[ScoringItem]]:
        """This data-parallel rank's shard of `dataset`, in token-budget batches, with a progress bar on rank 0."""
        shard = list(GenDistributedSampler(dataset, self.layout.dp_size, self.layout.dp_rank))
        b = self.batching
        batches = list(dataset.splits_iterator(shard, b.max_batch_tokens, b.max_batch_size))
        for positions in tqdm(batches, desc=desc, disable=not self.progress, leave=False):
            yield [dataset[i] for i in positions]

    def _vocab_shard(self, logits: torch.Tensor) -> VocabShard:
        lay = self.layout
        return VocabShard.of(logits.shape[-1], lay.tp_rank, lay.tp_group, lay.tp_size)

    def run_loglikelihood(self, dataset: LoglikelihoodDataset, desc: str = "loglikelihood") -> dict:
        """{key: LoglikelihoodResult} (rolling windows keyed (request key, window)); single-token rows give a
        list of results, one per choice. Same dict on every rank."""
        local: dict = {}
        for items in self._my_batches(dataset, desc):
            packed = isinstance(items[0], PackedRow)
            batch = make_packed_batch(items, self.pad_id, self.packs_rows) if packed else make_scoring_batch(
                items, self.pad_id)
            logits = self.backend.forward(batch)
            if logits is None:
                continue
            logprobs, greedy = target_logprobs(logits, batch.targets.to(logits.device), self._vocab_shard(logits))
            if packed:
                local.update((k, LoglikelihoodResult(*res)) for k, *res in split_packed(
                    items, logprobs.tolist(), greedy.tolist()))
            else:
                local.update(_split_rows(items, logprobs.tolist(), greedy.tolist()))
        return gather_dicts_over_dp(broadcast_from_output_stage(local, self.layout), self.layout)

    def run_greedy(self, dataset: GenerativeTaskDataset, desc: str = "generate") -> dict:
        """{key: GenerationResult}: greedy continuation up to a stop sequence, EOS or max_new_tokens."""
        local: dict = {}
        for items in self._my_batches(dataset, desc):
            local.update(self._generate(items))
        return gather_dicts_over_dp(broadcast_from_output_stage(local, self.layout), self.layout)

    def _generate(self, items: list[ScoringItem]) -> dict:
        """Greedy decoding by re-running the prompt each step (no KV cache: works for every backend).

        Every rank of the replica receives the chosen tokens from the output stage, so all agree on when to stop.
        """
        tok = self.backend.tokenizer
        max_new, stops = items[0].extra["max_new_tokens"], items[0].extra["stop"]
        generated: list[list[int]] = [[] for _ in items]
        active = list(range(len(items)))
        for _ in range(max_new):
            seqs = [items[i].tokens + generated[i] for i in active]
            batch = make_last_position_batch(seqs, self.pad_id)
            logits = self.backend.forward(batch)
            next_ids = torch.zeros(len(active), dtype=torch.int64, device=self.layout.device)
            if logits is not None:
                next_ids = argmax_tokens(logits, self._vocab_shard(logits)).to(next_ids.device)
            next_ids = broadcast_tensor_from_output_stage(next_ids, self.layout).tolist()
            still = []
            for i, t in zip(active, next_ids):
                if t == self.eos_id:
                    continue
                generated[i].append(t)
                if not _hit_stop(tok.decode(generated[i]), stops):
                    still.append(i)
            active = still
            if not active:
                break
        out = {}
        for item, gen in zip(items, generated):
            text = _cut_at_stop(tok.decode(gen), stops)
            out[item.key] = GenerationResult(text=text, tokens=gen, input_tokens=item.tokens, truncated=item.truncated)
        return out


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


def make_scoring_batch(items: Sequence[ScoringItem], pad_id: int) -> Batch:
    """Right-padded inputs (each row's tokens minus its last) and the positions that predict scored tokens."""
    width = max(it.length for it in items) - 1
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(items), width), dtype=torch.int64)
    rows, cols, targets = [], [], []
    for r, it in enumerate(items):
        n = it.length - 1
        input_ids[r, :n] = torch.tensor(it.tokens[:-1])
        mask[r, :n] = 1
        choice_ids = it.extra.get("choice_ids")
        if choice_ids is not None:  # single-token choices: all scored at the last position
            rows += [r] * len(choice_ids)
            cols += [n - 1] * len(choice_ids)
            targets += choice_ids
        else:
            rows += [r] * it.n_scored
            cols += range(n - it.n_scored, n)
            targets += it.tokens[-it.n_scored :]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return Batch(input_ids, mask, as_long(rows), as_long(cols), as_long(targets))


def make_last_position_batch(seqs: Sequence[list[int]], pad_id: int) -> Batch:
    """Right-padded full sequences; the logits wanted are at each row's last token (for generation)."""
    width = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for r, s in enumerate(seqs):
        input_ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = 1
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    rows = torch.arange(len(seqs), dtype=torch.int64)
    return Batch(input_ids, mask, rows, lengths - 1, torch.full((len(seqs),), -1, dtype=torch.int64))


def _split_rows(items: Sequence[ScoringItem], logprobs: list[float], greedy: list[bool]) -> dict:
    """Per-item results from the flat per-position scores of one batch (same order as make_scoring_batch)."""
    out, k = {}, 0
    for it in items:
        choice_ids = it.extra.get("choice_ids")
        if choice_ids is not None:
            n = len(choice_ids)
            out[it.key] = [LoglikelihoodResult(logprobs[k + j], greedy[k + j], 1, it.truncated) for j in range(n)]
        else:
            n = it.n_scored
            out[it.key] = LoglikelihoodResult(sum(logprobs[k : k + n]), all(greedy[k : k + n]), n, it.truncated)
        k += n
    return out


def _hit_stop(text: str, stops: Sequence[str]) -> bool:
    return any(s and s in text for s in stops)


def _cut_at_stop(text: str, stops: Sequence[str]) -> str:
    for s in stops:
        if s and s in text:
            text = text.split(s, 1)[0]
    return text
