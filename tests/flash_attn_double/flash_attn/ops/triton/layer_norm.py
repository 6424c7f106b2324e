"""TEST DOUBLE of flash_attn.ops.triton.layer_norm (no dropout): math in fp32, output in the input dtype."""

import torch


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, is_rms_norm=False, return_dropout_mask=False,
                  **unused):
    """y = norm(x + residual) * weight (+ bias); with prenorm also returns x + residual (the new residual stream)."""
    if dropout_p or x1 is not None or weight1 is not None or rowscale is not None or return_dropout_mask:
        raise NotImplementedError("flash_attn test double: dropout, x1/weight1 and rowscale are not supported")
    h = x.float() if residual is None else x.float() + residual.float()
    if is_rms_norm:
        y = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    else:
        y = torch.nn.functional.layer_norm(h, h.shape[-1:], eps=eps)
    y = y * weight.float() + (bias.float() if bias is not None else 0.0)
    y = y.to(x.dtype)
    if not prenorm:
        return y
    return y, h.to(torch.float32 if residual_in_fp32 else (residual.dtype if residual is not None else x.dtype))


def rms_norm_fn(x, weight, bias, residual=None, eps=1e-6, prenorm=False, residual_in_fp32=False, **kwargs):
    return layer_norm_fn(x, weight, bias, residual=residual, eps=eps, prenorm=prenorm,
                         residual_in_fp32=residual_in_fp32, is_rms_norm=True, **kwargs)
