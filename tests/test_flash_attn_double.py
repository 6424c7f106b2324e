"""The flash-attn test double (tests/flash_attn_double/) against naive formulas written out here."""

import math
import sys

import pytest
import torch

from tests.nanotron_cpu import DOUBLE_DIR

# Imported for this module only: the pytest process must not see a `flash_attn` afterwards (other tests check
# what a machine without flash-attn is told).
sys.path.insert(0, DOUBLE_DIR)
try:
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.flash_attn_interface import flash_attn_varlen_func, flash_attn_with_kvcache
    from flash_attn.layers.rotary import RotaryEmbedding
    from flash_attn.ops.triton.layer_norm import layer_norm_fn
finally:
    sys.path.remove(DOUBLE_DIR)
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def naive_attention(q, k, v, causal):
    """q [Lq, hq, d], k/v [Lk, hk, d]: softmax(q k^T / sqrt(d) + bottom-right causal mask) v, head by head."""
    lq, hq, d = q.shape
    lk, hk = k.shape[:2]
    out = torch.empty(lq, hq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hk)
        scores = q[:, h].double() @ k[:, kv].double().T / math.sqrt(d)
        for i in range(lq):
            for j in range(lk):
                if causal and j > i + lk - lq:
                    scores[i, j] = -math.inf
        out[:, h] = scores.softmax(-1) @ v[:, kv].double()
    return out


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_reads_each_sequence_at_its_offsets_with_gqa(causal):
    torch.manual_seed(0)
    lengths_q, lengths_k = [3, 5, 1], [3, 7, 4]  # Lq < Lk: causal mask aligned bottom-right
    q = torch.randn(sum(lengths_q), 4, 8)
    k, v = torch.randn(sum(lengths_k), 2, 8), torch.randn(sum(lengths_k), 2, 8)
    cu_q = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 10, 14], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=causal)
    for b in range(3):
        expected = naive_attention(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], causal)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]].double(), expected, atol=1e-6, rtol=1e-5)


def test_kvcache_appends_then_attends_to_the_filled_part():
    torch.manual_seed(1)
    k_cache, v_cache = torch.zeros(2, 6, 1, 4), torch.zeros(2, 6, 1, 4)
    past_k, past_v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    k_cache[:, :3], v_cache[:, :3] = past_k, past_v
    q, k, v = torch.randn(2, 1, 2, 4), torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4)
    lengths = torch.tensor([3, 2], dtype=torch.int32)  # row 1 has only 2 cached tokens: its new one lands at 2
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=True)
    for b, n in enumerate((3, 2)):
        keys = torch.cat([past_k[b, :n], k[b]]), torch.cat([past_v[b, :n], v[b]])
        torch.testing.assert_close(k_cache[b, n], k[b, 0])
        torch.testing.assert_close(out[b].double(), naive_attention(q[b], *keys, causal=True), atol=1e-6, rtol=1e-5)


def test_unpad_and_pad_are_inverse_on_kept_positions():
    x = torch.arange(2 * 4 * 3, dtype=torch.float).view(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    flat, indices, cu, longest = unpad_input(x, mask)
    assert flat.shape == (5, 3) and cu.tolist() == [0, 3, 5] and longest == 3 and indices.tolist() == [0, 1, 2, 4, 5]
    back = pad_input(flat, indices, 2, 4)
    assert torch.equal(back[mask], x[mask]) and not back[~mask].any()


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_rotates_the_documented_pairs(interleaved):
    torch.manual_seed(2)
    d, base, offset = 8, 10000.0, 3
    q, kv = torch.randn(2, 5, 4, d), torch.randn(2, 5, 2, 2, d)
    rq, rkv = RotaryEmbedding(d, base=base, interleaved=interleaved)(q, kv=kv, seqlen_offset=offset)
    for t in range(5):
        for i in range(d // 2):
            theta = (t + offset) * base ** (-2 * i / d)
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
            for x, r in ((q, rq), (kv[:, :, 0], rkv[:, :, 0])):
                torch.testing.assert_close(r[:, t, :, a], x[:, t, :, a] * math.cos(theta) - x[:, t, :, b] * math.sin(theta))
                torch.testing.assert_close(r[:, t, :, b], x[:, t, :, a] * math.sin(theta) + x[:, t, :, b] * math.cos(theta))
    assert torch.equal(rkv[:, :, 1], kv[:, :, 1])  # values are not rotated


def test_rms_and_layer_norm_with_residual():
    torch.manual_seed(3)
    x, res, w, b = torch.randn(3, 6), torch.randn(3, 6), torch.randn(6), torch.randn(6)
    h = x + res
    rms = h / torch.sqrt((h ** 2).mean(-1, keepdim=True) + 1e-5) * w
    y, new_res = layer_norm_fn(x, w, None, residual=res, eps=1e-5, prenorm=True, is_rms_norm=True)
    torch.testing.assert_close(y, rms)
    torch.testing.assert_close(new_res, h)
    ln = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5) * w + b
    torch.testing.assert_close(layer_norm_fn(x, w, b, eps=1e-5), ln)
