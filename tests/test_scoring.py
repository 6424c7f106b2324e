"""Vocab-parallel scoring equals the unsharded computation, on real gloo process groups."""

import torch
import torch.distributed as dist

from nano_eval.scoring import VocabShard, argmax_tokens, target_logprobs
from tests.dist_utils import run_distributed

N, V = 7, 48


def _data():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(N, V, generator=g) * 4
    logits[3, 10] = logits[3, 40] = logits[3].max() + 1  # a tie: the smallest id must win
    targets = torch.randint(0, V, (N,), generator=g)
    targets[0] = logits[0].argmax()
    return logits, targets


def test_unsharded_matches_log_softmax():
    logits, targets = _data()
    lp, greedy = target_logprobs(logits.half(), targets, VocabShard(0, V))
    ref = torch.log_softmax(logits.half().float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref, atol=1e-5, rtol=0)
    assert lp.dtype == torch.float32
    assert greedy.tolist() == (logits.half().float().argmax(-1) == targets).tolist()
    assert argmax_tokens(logits, VocabShard(0, V))[3].item() == 10


def test_float64_logits_are_scored_in_float64():
    """A float64 model is scored in float64 (not rounded to float32 first): what lets nano_eval's scores be compared
    with another implementation's to ~1e-10 (tests/test_parity_float64.py)."""
    logits, targets = _data()
    logits = logits.double() + 1e-9 * torch.arange(V, dtype=torch.float64)  # below float32's resolution at ~4
    lp, greedy = target_logprobs(logits, targets, VocabShard(0, V))
    ref = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, ref, atol=1e-13, rtol=0)
    assert argmax_tokens(logits, VocabShard(0, V))[3].item() == 40  # the 1e-9 step breaks the tie in float64 only


def _sharded(rank, world):
    logits, targets = _data()
    local = logits.chunk(world, dim=-1)[rank]
    shard = VocabShard.of(local.shape[-1], rank, dist.group.WORLD, world)
    lp, greedy = target_logprobs(local, targets, shard)
    return lp, greedy, argmax_tokens(local, shard)


def test_tp2_and_tp4_match_unsharded():
    logits, targets = _data()
    ref_lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    for world in (2, 4):
        for lp, greedy, arg in run_distributed(_sharded, world):
            torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
            assert arg.tolist() == logits.argmax(-1).tolist()
            assert greedy.tolist() == (logits.argmax(-1) == targets).tolist()
