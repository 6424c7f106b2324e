"""TEST DOUBLE of flash-attn 2.5's attention entry points, on torch's scaled_dot_product_attention.

Semantics kept from flash-attn: GQA (query head h reads kv head h // (hq / hk)); `causal` aligns the mask to the
bottom-right corner (query i of Lq may see key j iff j <= i + Lk - Lq); varlen rows are read ONLY at the offsets
given by cu_seqlens (rows past cu_seqlens[-1] are not attention outputs; real flash-attn leaves them
uninitialised, this double returns zeros there).
"""

import torch
import torch.nn.functional as F


def _attend(q, k, v, causal: bool, softmax_scale):
    """q [Lq, hq, d], k/v [Lk, hk, d] -> [Lq, hq, dv]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    mask = None
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         scale=softmax_scale)
    return out.transpose(0, 1)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, **unused):
    """q [total_q, hq, d], k/v [total_k, hk, d]; sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]."""
    if dropout_p or alibi_slopes is not None or tuple(window_size) != (-1, -1) or return_attn_probs:
        raise NotImplementedError("flash_attn test double: dropout, alibi, windows and attn probs are not supported")
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b]:
            out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal,
                                           softmax_scale)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), rotary_interleaved=True, alibi_slopes=None, **unused):
    """q [B, Lq, hq, d]; caches [B, Lc, hk, d] (updated in place with k/v [B, Lnew, hk, d] at cache_seqlens[b]);
    row b attends to its first cache_seqlens[b] + Lnew cache entries."""
    if rotary_cos is not None or cache_batch_idx is not None or alibi_slopes is not None:
        raise NotImplementedError("flash_attn test double: rotary, cache_batch_idx and alibi are not supported")
    batch = q.shape[0]
    if cache_seqlens is None:
        seqlens = [0 if k is not None else k_cache.shape[1]] * batch
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * batch
    else:
        seqlens = cache_seqlens.tolist()
    new = 0 if k is None else k.shape[1]
    outs = []
    for b in range(batch):
        if k is not None:
            k_cache[b, seqlens[b]:seqlens[b] + new] = k[b]
            v_cache[b, seqlens[b]:seqlens[b] + new] = v[b]
        end = seqlens[b] + new
        outs.append(_attend(q[b], k_cache[b, :end], v_cache[b, :end], causal, softmax_scale))
    return torch.stack(outs)
