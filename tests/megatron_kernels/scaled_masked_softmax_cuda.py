"""TEST DOUBLE (tests only; the product never imports it) of the CUDA extension `scaled_masked_softmax_cuda` that
megatron-core's FusedScaleMaskSoftmax imports (built by Apex / Megatron-LM), on torch.

forward(inputs [b, np, sq, sk] fp16/bf16, mask [b or 1, 1, sq, sk] (1/True = masked), scale): softmax of scale * inputs
in fp32 with masked elements set to -10000, a fully masked row giving zeros, in the input dtype.
backward(output_grads, softmax_results, scale): scale * (dy * y - y * sum(dy * y)).
get_batch_per_block(sq, sk, b, np): the kernel's rows per CUDA block, which FusedScaleMaskSoftmax.is_kernel_available
checks shapes against (so the real kernel selection runs). See tests/megatron_cpu.py for when it is on the path.
"""

from __future__ import annotations

import torch

from fused_softmax_double import MASKED_SCORE, batch_per_block, check_half, softmax_backward, softmax_forward


def forward(inputs: torch.Tensor, mask: torch.Tensor, scale) -> torch.Tensor:
    check_half("scaled_masked_softmax forward", inputs, 4)
    if mask.dim() != 4 or mask.shape[0] not in (1, inputs.shape[0]) or mask.shape[1] != 1 \
            or tuple(mask.shape[2:]) != tuple(inputs.shape[2:]):
        raise RuntimeError(f"scaled_masked_softmax: mask {tuple(mask.shape)} does not fit inputs {tuple(inputs.shape)}")
    return softmax_forward(inputs, scale, mask == 0, MASKED_SCORE)


def backward(output_grads: torch.Tensor, softmax_results: torch.Tensor, scale) -> torch.Tensor:
    return softmax_backward(output_grads, softmax_results, scale)


def get_batch_per_block(query_seq_len: int, key_seq_len: int, batches: int, attn_heads: int) -> int:
    return batch_per_block(query_seq_len, key_seq_len, batches, attn_heads)
