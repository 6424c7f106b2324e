"""TEST DOUBLE (tests only; the product never imports it) of flash-attn 2.8's compiled module `flash_attn_2_cuda`,
written on torch, for CPU test processes.

The real `flash_attn` Python package (2.8.3, installed without its CUDA build) imports this module as its kernels:
`flash_attn_interface` calls `fwd`, `varlen_fwd`, `bwd`, `varlen_bwd` and `fwd_kvcache` with the positional
arguments of flash-attn's C++ API (csrc/flash_attn/flash_api.cpp), and everything above them (argument checks,
head-size padding, autograd functions, `bert_padding`, `RotaryEmbedding`) is flash-attn's own code.

Semantics kept from the CUDA kernels (each checked against a naive loop in tests/test_flash_attn_double.py):
- GQA: query head h reads key/value head h // (hq / hk);
- masks aligned to the bottom-right corner: query i of Lq may see key j iff
  i + Lk - Lq - window_left <= j <= i + Lk - Lq + window_right (-1: unbounded); causal is window_right = 0;
- softcap > 0: scores -> softcap * tanh(scores / softcap); scores are scaled by softmax_scale first;
- softmax_lse is the fp32 log-sum-exp of each query row's scaled scores ([B, hq, Lq], varlen: [hq, total_q]),
  +inf and an output of zeros for a row that sees no key;
- varlen: sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]; rows past cu_seqlens_q[-1] are not attention outputs
  (the kernel leaves them uninitialised; zeros here); seqused_k[b] keys of sequence b when given;
- kvcache: k/v [B, Lnew, hk, d] are written into the caches in place at cache_seqlens[b] (of cache row
  cache_batch_idx[b] when given), then row b attends to its first cache_seqlens[b] + Lnew cache entries;
- backward: dq, dk, dv filled in place (allocated when None), softmax_d = rowsum(dout * out) in fp32.
Arithmetic is fp32 whatever the input dtype, results in the input dtype (the kernels accumulate in fp32). Unlike
the kernels, fp32 inputs are accepted, so the CPU tests can compare fp32 models at 1e-5. Not implemented (raise
NotImplementedError): dropout, ALiBi, paged caches (block_table), left-padded caches (leftpad_k), rotary inside
the kvcache kernel, returning the attention probabilities.
"""

from __future__ import annotations

import torch

__version__ = "2.8.3+nano_eval_cpu_test_double"


def _unsupported(**flags) -> None:
    used = [name for name, value in flags.items() if value is not None and value is not False and value != 0.0]
    if used:
        raise NotImplementedError(f"flash_attn_2_cuda test double: {', '.join(used)} not supported")


def _probabilities(q, k, scale: float, causal: bool, left: int, right: int, softcap: float):
    """One sequence: q [Lq, hq, d], k [Lk, hk, d] -> (probs [hq, Lq, Lk], lse [hq, Lq], tanh of the capped scores or
    None), fp32; rows that see no key have zero probabilities and lse -inf."""
    lq, hq = q.shape[:2]
    lk, hk = k.shape[:2]
    qf = q.float().transpose(0, 1)  # [hq, Lq, d]
    kf = k.float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale  # [hq, Lq, Lk]
    capped = None
    if softcap > 0:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    if causal:
        right = 0
    diagonal = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # the key column aligned with query i
    keys = torch.arange(lk, device=q.device)[None, :]
    seen = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
    if right >= 0:
        seen &= keys <= diagonal + right
    if left >= 0:
        seen &= keys >= diagonal - left
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [hq, Lq]
    empty = torch.isinf(lse)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    return probs, lse, capped


def _attend(q, k, v, scale: float, causal: bool, left: int, right: int, softcap: float):
    """One sequence: q [Lq, hq, d], k/v [Lk, hk, dv] -> (out [Lq, hq, dv] in q's dtype, lse [hq, Lq] fp32, +inf for a
    row that sees no key)."""
    probs, lse, _ = _probabilities(q, k, scale, causal, left, right, softcap)
    vf = v.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(0, 1)  # [hq, Lk, dv]
    out = (probs @ vf).transpose(0, 1)  # [Lq, hq, dv]
    return out.to(q.dtype), lse.masked_fill(torch.isinf(lse), float("inf"))


def _attend_grads(dout, q, k, v, scale, causal, left, right, softcap):
    """(dq, dk, dv) of one sequence in fp32, by the attention backward formulas (as the kernel computes them):
    dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), through the softcap's tanh, dQ = scale dS K, dK = scale dS^T Q,
    key/value gradients summed over the query heads of their group."""
    hq, hk = q.shape[1], k.shape[1]
    probs, _, capped = _probabilities(q, k, scale, causal, left, right, softcap)
    do = dout.float().transpose(0, 1)  # [hq, Lq, dv]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(hq // hk, dim=1).transpose(0, 1)
    out = probs @ vf
    dv = probs.transpose(1, 2) @ do  # [hq, Lk, dv]
    ds = probs * (do @ vf.transpose(1, 2) - (do * out).sum(-1, keepdim=True))
    if capped is not None:
        ds = ds * (1 - capped.square())
    dq = scale * ds @ kf  # [hq, Lq, d]
    dk = scale * ds.transpose(1, 2) @ qf  # [hq, Lk, d]

    def per_kv_head(g):  # [hq, L, x] -> [L, hk, x]
        return g.view(hk, hq // hk, *g.shape[1:]).sum(1).transpose(0, 1)

    return dq.transpose(0, 1), per_kv_head(dk), per_kv_head(dv)


def fwd(q, k, v, out, alibi_slopes, p_dropout, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
        return_softmax, gen):
    """q [B, Lq, hq, d], k/v [B, Lk, hk, d] -> [out, softmax_lse [B, hq, Lq], p (empty), rng_state]."""
    _unsupported(alibi_slopes=alibi_slopes, dropout=p_dropout, return_softmax=return_softmax)
    results = [_attend(q[b], k[b], v[b], softmax_scale, is_causal, window_size_left, window_size_right, softcap)
               for b in range(q.shape[0])]
    result = torch.stack([o for o, _ in results])
    if out is not None:
        out.copy_(result)
        result = out
    return [result, torch.stack([lse for _, lse in results]), q.new_empty(0), _rng_state(q)]


def varlen_fwd(q, k, v, out, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left,
               window_size_right, softcap, return_softmax, gen):
    """q [total_q, hq, d], k/v [total_k, hk, d] -> [out, softmax_lse [hq, total_q], p (empty), rng_state]."""
    _unsupported(leftpad_k=leftpad_k, block_table=block_table, alibi_slopes=alibi_slopes, dropout=p_dropout,
                 return_softmax=return_softmax)
    result = q.new_zeros(*q.shape[:2], v.shape[-1]) if out is None else out.zero_()
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32, device=q.device)
    for (q0, q1), (k0, k1) in _spans(cu_seqlens_q, cu_seqlens_k, seqused_k):
        result[q0:q1], lse[:, q0:q1] = _attend(q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, is_causal,
                                               window_size_left, window_size_right, softcap)
    return [result, lse, q.new_empty(0), _rng_state(q)]


def bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, alibi_slopes, p_dropout, softmax_scale, is_causal,
        window_size_left, window_size_right, softcap, deterministic, gen, rng_state):
    """Gradients of fwd into dq, dk, dv (in place); returns [dq, dk, dv, softmax_d [B, hq, Lq]]."""
    _unsupported(alibi_slopes=alibi_slopes, dropout=p_dropout)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv)
    for b in range(q.shape[0]):
        grads = _attend_grads(dout[b], q[b], k[b], v[b], softmax_scale, is_causal, window_size_left,
                              window_size_right, softcap)
        for buffer, grad in zip((dq, dk, dv), grads):
            buffer[b].copy_(grad)
    return [dq, dk, dv, (dout.float() * out.float()).sum(-1).transpose(1, 2)]


def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, alibi_slopes, max_seqlen_q,
               max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal, window_size_left, window_size_right,
               softcap, deterministic, gen, rng_state):
    """Gradients of varlen_fwd into dq, dk, dv (in place); returns [dq, dk, dv, softmax_d [hq, total_q]]."""
    _unsupported(alibi_slopes=alibi_slopes, dropout=p_dropout)
    dq, dk, dv = _grad_buffers(q, k, v, dq, dk, dv)
    for buffer in (dq, dk, dv):
        buffer.zero_()
    for (q0, q1), (k0, k1) in _spans(cu_seqlens_q, cu_seqlens_k, None):
        grads = _attend_grads(dout[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], softmax_scale, is_causal,
                              window_size_left, window_size_right, softcap)
        for buffer, grad, (a, z) in zip((dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1))):
            buffer[a:z].copy_(grad)
    return [dq, dk, dv, (dout.float() * out.float()).sum(-1).T.contiguous()]


def fwd_kvcache(q, kcache, vcache, k, v, seqlens_k, rotary_cos, rotary_sin, cache_batch_idx, leftpad_k, block_table,
                alibi_slopes, out, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
                is_rotary_interleaved, num_splits):
    """q [B, Lq, hq, d]; caches [B_cache, L_cache, hk, d]; k/v [B, Lnew, hk, d] or None; seqlens_k [B] int32 or None
    (None: the whole cache is valid) -> [out [B, Lq, hq, dv], softmax_lse [B, hq, Lq]]."""
    _unsupported(rotary_cos=rotary_cos, leftpad_k=leftpad_k, block_table=block_table, alibi_slopes=alibi_slopes)
    batch = q.shape[0]
    if seqlens_k is None and k is not None:
        raise NotImplementedError("flash_attn_2_cuda test double: appending k/v needs cache_seqlens")
    lengths = [kcache.shape[1]] * batch if seqlens_k is None else seqlens_k.tolist()
    rows = list(range(batch)) if cache_batch_idx is None else cache_batch_idx.tolist()
    new = 0 if k is None else k.shape[1]
    outs, lses = [], []
    for b, (row, n) in enumerate(zip(rows, lengths)):
        if k is not None:
            kcache[row, n:n + new] = k[b]
            vcache[row, n:n + new] = v[b]
        o, lse = _attend(q[b], kcache[row, :n + new], vcache[row, :n + new], softmax_scale, is_causal,
                         window_size_left, window_size_right, softcap)
        outs.append(o)
        lses.append(lse)
    result = torch.stack(outs)
    if out is not None:
        out.copy_(result)
        result = out
    return [result, torch.stack(lses)]


def _spans(cu_seqlens_q, cu_seqlens_k, seqused_k):
    """((q0, q1), (k0, k1)) of each varlen sequence."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    for b in range(len(cq) - 1):
        k1 = ck[b + 1] if used is None else ck[b] + used[b]
        yield (cq[b], cq[b + 1]), (ck[b], k1)


def _grad_buffers(q, k, v, dq, dk, dv):
    return tuple(torch.empty_like(t) if g is None else g for t, g in ((q, dq), (k, dk), (v, dv)))


def _rng_state(q) -> torch.Tensor:
    return torch.zeros(2, dtype=torch.int64, device=q.device)  # (seed, offset) of dropout: no dropout here
