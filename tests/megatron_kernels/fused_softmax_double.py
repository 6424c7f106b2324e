"""Shared arithmetic of the fused-softmax CUDA-extension test doubles in this folder (tests only; the product never
imports it): see scaled_masked_softmax_cuda.py."""

from __future__ import annotations

import torch

MASKED_SCORE = -10000.0  # what the masked kernel writes for a masked element (as megatron's attention_mask_func)


def check_half(name: str, tensor: torch.Tensor, dims: int) -> None:
    """The CUDA kernels take fp16 / bf16 tensors of a fixed rank only."""
    if tensor.dim() != dims:
        raise RuntimeError(f"{name}: expected a {dims}D tensor, got {tuple(tensor.shape)}")
    if tensor.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"{name}: only fp16 and bf16 are supported, got {tensor.dtype}")


def softmax_forward(scores: torch.Tensor, scale: float, keep: torch.Tensor | None, masked_value: float) -> torch.Tensor:
    """softmax over the last dim of scale * scores in fp32, `keep` False -> `masked_value` (-inf: excluded, output 0);
    a row whose maximum is MASKED_SCORE (every element masked by the masked kernel) gives zeros. Result in the
    input dtype."""
    x = scores.float() * float(scale)
    if keep is not None:
        x = x.masked_fill(~keep, masked_value)
    probs = torch.softmax(x, dim=-1)
    probs = probs.masked_fill(x.amax(dim=-1, keepdim=True) == MASKED_SCORE, 0.0)
    return probs.to(scores.dtype)


def softmax_backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * (dy * y - y * sum(dy * y)) in fp32, result in the gradient's dtype (as the kernels compute it)."""
    y, dy = softmax_results.float(), output_grads.float()
    grad = float(scale) * (dy * y - y * (dy * y).sum(dim=-1, keepdim=True))
    return grad.to(output_grads.dtype)


def batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
    """Rows of the softmax one CUDA block handles: 128 threads, warps of min(32, next power of two >= sk) threads,
    2 rows per warp up to 128 elements, else 1 (the launch geometry megatron-core checks shapes against)."""
    power = 1 << max(0, (sk - 1).bit_length())
    warp = min(power, 32)
    return (128 // warp) * (2 if power <= 128 else 1)
