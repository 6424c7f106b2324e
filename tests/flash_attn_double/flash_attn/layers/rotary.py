"""TEST DOUBLE of flash_attn.layers.rotary.RotaryEmbedding (forward only; math in fp32, result in the input dtype).

interleaved=True rotates pairs (x[2i], x[2i+1]) (GPT-J style, what nanotron 0.4 trains with);
interleaved=False rotates (x[i], x[i + d/2]) (GPT-NeoX / transformers style). Position of token t is t +
seqlen_offset; frequency i is base ** (-2i / dim).
"""

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [B, S, H, d]; cos/sin [S, rd/2] fp32. The first rd dims are rotated, the rest pass through."""
    rd = 2 * cos.shape[-1]
    xr = x[..., :rd].float()
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
    else:
        a, b = xr[..., : rd // 2], xr[..., rd // 2:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    ra, rb = a * c - b * s, a * s + b * c
    rotated = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., rd:]), dim=-1)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True, device=None):
        super().__init__()
        if scale_base is not None:
            raise NotImplementedError("flash_attn test double: XPos (scale_base) is not supported")
        self.dim, self.base, self.interleaved = dim, float(base), interleaved

    def cos_sin(self, seqlen: int, offset: int, device):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim))
        angles = torch.outer(torch.arange(offset, offset + seqlen, dtype=torch.float32, device=device), inv_freq)
        return angles.cos(), angles.sin()

    def forward(self, qkv, kv=None, seqlen_offset: int = 0, max_seqlen=None):
        """qkv [B, S, 3, H, d] -> same with q and k rotated; or q [B, S, H, d] and kv [B, S, 2, Hk, d] -> (q, kv)."""
        if not isinstance(seqlen_offset, int):
            raise NotImplementedError("flash_attn test double: per-row seqlen offsets are not supported")
        cos, sin = self.cos_sin(qkv.shape[1], seqlen_offset, qkv.device)
        if kv is None:
            q, k = (apply_rotary(qkv[:, :, i], cos, sin, self.interleaved) for i in (0, 1))
            return torch.stack((q, k, qkv[:, :, 2]), dim=2)
        q = apply_rotary(qkv, cos, sin, self.interleaved)
        k = apply_rotary(kv[:, :, 0], cos, sin, self.interleaved)
        return q, torch.stack((k, kv[:, :, 1]), dim=2)
