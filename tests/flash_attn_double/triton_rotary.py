"""TEST DOUBLE (tests only) of flash-attn 2.8's Triton kernel module `flash_attn.ops.triton.rotary`, on torch.

`apply_rotary` launches the Triton kernel `rotary_kernel` in flash-attn; here the same rotation is written with torch
ops (Triton needs a GPU). flash-attn's own `flash_attn.layers.rotary` (RotaryEmbedding, its cos/sin cache and autograd
functions) runs unchanged on top of it. Semantics kept from the kernel: position of token t of row b is
t + seqlen_offsets (an int or a [B] tensor); cos/sin [seqlen_ro, rotary_dim / 2]; the first rotary_dim features are
rotated in pairs (x[2i], x[2i+1]) when interleaved, (x[i], x[i + rotary_dim/2]) otherwise, the rest pass through;
conjugate rotates by -angle (the backward); arithmetic in fp32, result in x's dtype; inplace writes into x.
Checked against the rotation written out in tests/test_flash_attn_double.py.
"""

from __future__ import annotations

import torch


def apply_rotary(x, cos, sin, seqlen_offsets=0, cu_seqlens=None, max_seqlen=None, interleaved=False, inplace=False,
                 conjugate=False):
    """x [B, S, H, d] (or [total, H, d] with cu_seqlens [B+1]) -> the same shape, rotated."""
    rotary_dim = 2 * cos.shape[-1]
    if cu_seqlens is None:
        positions = torch.arange(x.shape[1], device=x.device)[None, :] + _offsets(seqlen_offsets, x.shape[0], x.device)
    else:
        starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        row = torch.repeat_interleave(torch.arange(len(lengths), device=x.device), lengths)
        within = torch.arange(x.shape[0], device=x.device) - starts[row]
        positions = within + _offsets(seqlen_offsets, len(lengths), x.device)[row, 0]
    if int(positions.max()) >= cos.shape[0]:
        raise ValueError(f"rotary positions reach {int(positions.max())}, cos/sin cover {cos.shape[0]}")
    c, s = cos.float()[positions], sin.float()[positions]  # [B, S, rd/2] or [total, rd/2]
    c, s = c.unsqueeze(-2), s.unsqueeze(-2)  # broadcast over heads
    if conjugate:
        s = -s
    part = x[..., :rotary_dim].float()
    a, b = (part[..., 0::2], part[..., 1::2]) if interleaved else part.chunk(2, dim=-1)
    ra, rb = a * c - b * s, a * s + b * c
    rotated = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), dim=-1)
    out = x if inplace else x.clone()
    out[..., :rotary_dim] = rotated.to(x.dtype)
    return out


def _offsets(seqlen_offsets, batch: int, device) -> torch.Tensor:
    """[B, 1] int64 position offsets."""
    if isinstance(seqlen_offsets, torch.Tensor):
        return seqlen_offsets.to(device=device, dtype=torch.int64)[:, None]
    return torch.full((batch, 1), int(seqlen_offsets), dtype=torch.int64, device=device)
