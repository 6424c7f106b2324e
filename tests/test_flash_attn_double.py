"""The real flash-attn package (2.8.3) on its test-double kernels (tests/flash_attn_cpu.py) against naive formulas
written out here: every entry point nanotron calls goes through flash-attn's own Python code into the doubles."""

import math

import pytest
import torch

from tests import flash_attn_cpu

# Imported for this module only: the pytest process must not see a `flash_attn` afterwards (other tests check what a
# machine without flash-attn's kernels is told).
flash_attn = flash_attn_cpu.install()
try:
    from flash_attn import __version__ as FLASH_ATTN_VERSION
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.flash_attn_interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flash_attn.layers.rotary import RotaryEmbedding
    from flash_attn.ops.triton.layer_norm import layer_norm_fn
finally:
    flash_attn_cpu.uninstall()


def test_the_real_package_runs_on_the_doubles():
    assert FLASH_ATTN_VERSION == "2.8.3"
    assert flash_attn.__file__.endswith("site-packages/flash_attn/__init__.py")
    assert "tests/flash_attn_double" in flash_attn.flash_attn_interface.flash_attn_gpu.__file__


def naive_attention(q, k, v, causal, window=(-1, -1), softcap=0.0):
    """q [Lq, hq, d], k/v [Lk, hk, d]: softmax(q k^T / sqrt(d), masked bottom-right aligned) v, head by head, in
    float64; a query that sees no key gives zeros."""
    lq, hq, d = q.shape
    lk, hk = k.shape[:2]
    out = torch.zeros(lq, hq, v.shape[-1], dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for h in range(hq):
        kv = h // (hq // hk)
        scores = q[:, h].double() @ k[:, kv].double().T / math.sqrt(d)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        for i in range(lq):
            for j in range(lk):
                diagonal = i + lk - lq
                if (right >= 0 and j > diagonal + right) or (left >= 0 and j < diagonal - left):
                    scores[i, j] = -math.inf
            if torch.isfinite(scores[i]).any():
                out[i, h] = scores[i].softmax(-1) @ v[:, kv].double()
    return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_reads_each_sequence_at_its_offsets_with_gqa(causal, dtype):
    torch.manual_seed(0)
    lengths_q, lengths_k = [3, 5, 1], [3, 7, 4]  # Lq < Lk: causal mask aligned bottom-right
    q = torch.randn(sum(lengths_q), 4, 8, dtype=dtype)
    k, v = torch.randn(sum(lengths_k), 2, 8, dtype=dtype), torch.randn(sum(lengths_k), 2, 8, dtype=dtype)
    cu_q = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 10, 14], dtype=torch.int32)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=causal)
    assert out.dtype == dtype
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for b in range(3):
        expected = naive_attention(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], causal)
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]].double(), expected, **tol)


def test_varlen_backward_equals_autograd_through_the_naive_formula():
    torch.manual_seed(4)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = (torch.randn(9, h, 8, requires_grad=True) for h in (4, 2, 2))
    weights = torch.randn(9, 4, 8)
    (flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True) * weights).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = torch.cat([naive_attention(qd[a:b], kd[a:b], vd[a:b], True) for a, b in ((0, 4), (4, 9))])
    (expected * weights.double()).sum().backward()
    for got, want in zip(grads, (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


def test_dense_kernel_windows_and_softcap_forward_and_backward():
    torch.manual_seed(5)
    q, k, v = (torch.randn(2, n, h, 8, requires_grad=True) for n, h in ((6, 4), (9, 2), (9, 2)))
    weights = torch.randn(2, 6, 4, 8)
    out = flash_attn_func(q, k, v, causal=True, window_size=(3, 0), softcap=2.0)
    (out * weights).sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = torch.stack([naive_attention(qd[b], kd[b], vd[b], True, (3, 0), 2.0) for b in range(2)])
    torch.testing.assert_close(out.detach().double(), expected.detach(), atol=1e-6, rtol=1e-5)
    (expected * weights.double()).sum().backward()
    for got, want in zip((q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-4)


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


def test_unpad_input_returns_five_values_from_2_6_on_and_pad_input_inverts_it():
    """flash-attn >= 2.6: (kept rows, their flat indices, cu_seqlens, longest, used lengths); nanotron 0.4 unpacks 4
    (nano_eval.compat.nanotron adapts it)."""
    x = torch.arange(2 * 4 * 3, dtype=torch.float).view(2, 4, 3)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    flat, indices, cu, longest, used = unpad_input(x, mask)
    assert flat.shape == (5, 3) and cu.tolist() == [0, 3, 5] and longest == 3 and indices.tolist() == [0, 1, 2, 4, 5]
    assert used.tolist() == [3, 2]
    back = pad_input(flat, indices, 2, 4)
    assert torch.equal(back[mask], x[mask]) and not back[~mask].any()


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_rotates_the_documented_pairs(interleaved):
    torch.manual_seed(2)
    d, base, offset = 8, 10000.0, 3
    q, kv = torch.randn(2, 5, 4, d), torch.randn(2, 5, 2, 2, d)
    rq, rkv = RotaryEmbedding(d, base=base, interleaved=interleaved)(q.clone(), kv=kv.clone(), seqlen_offset=offset)
    for t in range(5):
        for i in range(d // 2):
            theta = (t + offset) * base ** (-2 * i / d)
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
            for x, r in ((q, rq), (kv[:, :, 0], rkv[:, :, 0])):
                torch.testing.assert_close(r[:, t, :, a], x[:, t, :, a] * math.cos(theta) - x[:, t, :, b] * math.sin(theta))
                torch.testing.assert_close(r[:, t, :, b], x[:, t, :, a] * math.sin(theta) + x[:, t, :, b] * math.cos(theta))
    assert torch.equal(rkv[:, :, 1], kv[:, :, 1])  # values are not rotated


def test_rotary_backward_rotates_back():
    """flash-attn's autograd function computes the backward with the conjugate rotation (the double's
    `conjugate=True`): the gradient of sum(w * R x) is R^T w."""
    torch.manual_seed(6)
    rotary = RotaryEmbedding(8, interleaved=True)
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    kv = torch.randn(1, 4, 2, 2, 8)
    w = torch.randn(1, 4, 2, 8)
    rq, _ = rotary(q, kv=kv)
    (rq * w).sum().backward()
    jacobian = torch.autograd.functional.jacobian(lambda x: rotary(x, kv=kv.clone())[0], q.detach())
    torch.testing.assert_close(q.grad, torch.einsum("abcd,abcdefgh->efgh", w, jacobian))


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
