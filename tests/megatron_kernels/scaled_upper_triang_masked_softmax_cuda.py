"""TEST DOUBLE (tests only; the product never imports it) of the CUDA extension `scaled_upper_triang_masked_softmax_cuda`
that megatron-core's ScaledUpperTriangMaskedSoftmax imports (built by Apex / Megatron-LM), on torch.

forward(inputs [attn_batches, sq, sk] fp16/bf16, scale): softmax of scale * inputs over keys 0..i for query i, in fp32,
zeros above the diagonal, in the input dtype. It takes NO mask: any padding mask the caller holds is dropped (the
kernel's contract, which megatron-core's FusedScaleMaskSoftmax relies on for causal layers). backward(output_grads,
softmax_results, scale): scale * (dy * y - y * sum(dy * y)). See tests/megatron_cpu.py for when it is on the path.
"""

from __future__ import annotations

import torch

from fused_softmax_double import check_half, softmax_backward, softmax_forward


def forward(inputs: torch.Tensor, scale) -> torch.Tensor:
    check_half("scaled_upper_triang_masked_softmax forward", inputs, 3)
    sq, sk = inputs.shape[1:]
    if sq != sk:
        raise RuntimeError(f"scaled_upper_triang_masked_softmax: causal self-attention only, got sq={sq}, sk={sk}")
    causal = torch.ones(sq, sk, dtype=torch.bool, device=inputs.device).tril()
    return softmax_forward(inputs, scale, causal, float("-inf"))


def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale) -> torch.Tensor:
    return softmax_backward(output_grads, softmax_results, scale)
