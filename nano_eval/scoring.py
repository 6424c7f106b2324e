"""Vocab-parallel scoring: log-probs, greedy flags and argmax tokens from vocab-sharded logits.

Under tensor parallelism each TP rank holds logits for its slice of the vocabulary, `[N, V/tp]`. We never gather
the full vocabulary: the log-sum-exp, the target logit and the argmax are each reduced over the TP group as one
scalar per scored position. All arithmetic is fp32, or fp64 for fp64 logits (a float64 model is scored in float64,
so it can be compared with another implementation to ~1e-10: scripts/parity_precision.py). With tp=1 the same code
runs without collectives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from nano_eval.parallel import all_reduce

# Larger than any vocabulary id: the "no candidate" value when ranks agree on the argmax with a MIN reduction.
_NO_TOKEN = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice [start, start + size) of the (padded) vocabulary, and the TP group that holds the rest."""

    start: int
    size: int
    group: object = None
    group_size: int = 1

    @classmethod
    def of(cls, local_vocab: int, tp_rank: int, tp_group, tp_size: int) -> VocabShard:
        return cls(start=tp_rank * local_vocab, size=local_vocab, group=tp_group, group_size=tp_size)


def _at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    """Logits upcast to fp32 (bf16 / fp16), fp64 kept: never rounded down."""
    return logits if logits.dtype == torch.float64 else logits.float()


def _log_normaliser(logits: torch.Tensor, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """Global max [N] and log-sum-exp [N] of fp32 (or fp64) logits [N, V/tp] over the whole vocabulary."""
    global_max = all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, shard.group, shard.group_size)
    sum_exp = (logits - global_max.unsqueeze(-1)).exp().sum(dim=-1)
    sum_exp = all_reduce(sum_exp, dist.ReduceOp.SUM, shard.group, shard.group_size)
    return global_max, global_max + sum_exp.log()


# The "token" argmax_tokens returns for a position whose logits hold a NaN or an infinity on any TP rank.
NON_FINITE = -1


def argmax_tokens(logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Global argmax token id [N] of logits [N, V/tp]; ties go to the smallest id, as torch.argmax does.

    A position whose logits hold a NaN or +inf on some TP rank, or are -inf everywhere, has no argmax and gets
    NON_FINITE on every rank: a rank holding NaN enters the MAX reduction with +inf (never with NaN, which reductions
    need not propagate), so every rank sees an infinite maximum. (A -inf logit among finite ones is a masked token.)"""
    logits = _at_least_fp32(logits)
    local_max, local_arg = logits.max(dim=-1)
    local_max = torch.where(logits.isnan().any(dim=-1), torch.inf, local_max)
    global_max = all_reduce(local_max.clone(), dist.ReduceOp.MAX, shard.group, shard.group_size)
    candidate = torch.where(local_max == global_max, local_arg + shard.start, torch.full_like(local_arg, _NO_TOKEN))
    tokens = all_reduce(candidate, dist.ReduceOp.MIN, shard.group, shard.group_size)
    return torch.where(global_max.isinf(), torch.full_like(tokens, NON_FINITE), tokens)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob [N] of each target id and whether it is the greedy (argmax) token [N].

    logits: [N, V/tp] at the scored positions only, any dtype (upcast to fp32 here; fp64 stays fp64); targets: [N]
    global vocabulary ids. Every rank of the TP group receives the same results.
    """
    logits = _at_least_fp32(logits)
    _, log_z = _log_normaliser(logits, shard)
    local_ids = targets - shard.start
    in_shard = (local_ids >= 0) & (local_ids < shard.size)
    picked = logits.gather(-1, local_ids.clamp(0, shard.size - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = all_reduce(torch.where(in_shard, picked, 0.0), dist.ReduceOp.SUM, shard.group, shard.group_size)
    is_greedy = argmax_tokens(logits, shard) == targets
    return target_logit - log_z, is_greedy
