"""TEST DOUBLE of `grouped_gemm.ops` on plain torch (autograd for free), for nanotron main on CPU.

nanotron main imports `grouped_gemm.ops` when `nanotron.nn.moe` is imported, which `nanotron.scaling` imports: even a
dense Qwen2 needs the module. The real one is CUDA-only (its Python wrapper refuses CPU tensors). nanotron uses three
functions, kept with the real semantics:
- gmm(a [T, K], b [E, K, N], batch_sizes [E]): the first batch_sizes[0] rows of `a` times b[0], the next
  batch_sizes[1] rows times b[1], ... (trans_b: b is [E, N, K]);
- permute(x [T, H], indices [T, k]): x's rows grouped by expert 0..E-1 (each token once per chosen expert, stable
  order), and an opaque map for unpermute;
- unpermute(y [T*k, H], map, probs [T, k]): sum over j of probs[t, j] * y[row of (t, j)].
The real kernel takes bf16 only; this one takes any float dtype (the tests run fp32).
"""

from __future__ import annotations

import torch


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    if batch_sizes.numel() != b.shape[0]:
        raise RuntimeError(f"grouped_gemm double: {batch_sizes.numel()} batch sizes for {b.shape[0]} experts")
    chunks = a.split(batch_sizes.tolist())
    outs = [chunk @ (w.t() if trans_b else w) for chunk, w in zip(chunks, b)]
    return torch.cat(outs) if outs else a.new_zeros(0, b.shape[1] if trans_b else b.shape[2])


def permute(x: torch.Tensor, indices: torch.Tensor, num_out_tokens=None, max_token_num: int = 0):
    if num_out_tokens:
        raise NotImplementedError("grouped_gemm double: token dropping (num_out_tokens) is not modelled")
    order = torch.sort(indices.reshape(-1).long(), stable=True).indices  # flattened (token, choice) slots by expert
    return x[order // indices.shape[1]], order


def unpermute(y: torch.Tensor, order: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    slots = torch.empty_like(y)
    slots[order] = y  # back to (token, choice) order
    tokens, k = probs.shape
    return (slots.view(tokens, k, -1) * probs.unsqueeze(-1).to(y.dtype)).sum(dim=1)
