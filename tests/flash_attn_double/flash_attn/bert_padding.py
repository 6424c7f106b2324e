"""TEST DOUBLE of flash_attn.bert_padding (2.5: unpad_input returns 4 values)."""

import torch


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    return x[indices]


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor):
    """[B, S, ...] and a [B, S] keep-mask -> ([total, ...] kept rows, their flat indices, cu_seqlens int32 [B+1],
    longest length)."""
    lengths = attention_mask.sum(-1, dtype=torch.int32)
    indices = attention_mask.flatten().nonzero().flatten()
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(lengths.max())


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Inverse of unpad_input: [total, ...] -> [batch, seqlen, ...], zeros where nothing was kept."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])
