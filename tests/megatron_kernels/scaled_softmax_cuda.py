"""TEST DOUBLE (tests only; the product never imports it) of the CUDA extension `scaled_softmax_cuda` that
megatron-core's ScaledSoftmax imports (built by Apex / Megatron-LM), on torch: forward(inputs [b, np, sq, sk]
fp16/bf16, scale) = softmax of scale * inputs in fp32, in the input dtype; backward as the masked kernel's.
See tests/megatron_cpu.py for when it is on the path.
"""

from __future__ import annotations

import torch

from fused_softmax_double import check_half, softmax_backward, softmax_forward


def forward(inputs: torch.Tensor, scale) -> torch.Tensor:
    check_half("scaled_softmax forward", inputs, 4)
    return softmax_forward(inputs, scale, None, 0.0)


def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale) -> torch.Tensor:
    return softmax_backward(output_grads, softmax_results, scale)
