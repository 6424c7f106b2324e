"""TEST DOUBLE (tests only) of flash-attn 2.8's Triton kernel module `flash_attn.ops.triton.layer_norm`, on torch.

The module is Triton kernels plus their launchers and autograd wrappers; nanotron 0.4 calls only `layer_norm_fn`
(its TritonRMSNorm / TritonLayerNorm). Here `layer_norm_fn` and `rms_norm_fn` are written with torch ops, so
autograd gives the backward. Semantics kept: y = norm(x + residual) * weight (+ bias) with the statistics in fp32,
y in x's dtype (or out_dtype); with prenorm also the new residual stream x + residual (in residual's dtype;
without a residual, fp32 when residual_in_fp32, else x's dtype). Not implemented (raise NotImplementedError):
dropout, the second input/weight (x1, weight1), rowscale. Checked against the formulas written out in
tests/test_flash_attn_double.py.
"""

from __future__ import annotations

import torch


def layer_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                  rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False, is_rms_norm=False,
                  return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    if dropout_p or x1 is not None or weight1 is not None or rowscale is not None or return_dropout_mask:
        raise NotImplementedError("flash-attn layer_norm test double: dropout, x1/weight1 and rowscale not supported")
    h = x.float() if residual is None else x.float() + residual.float()
    if is_rms_norm:
        y = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    else:
        y = torch.nn.functional.layer_norm(h, h.shape[-1:], eps=eps)
    w = weight.float() + 1.0 if zero_centered_weight else weight.float()
    y = y * w + (bias.float() if bias is not None else 0.0)
    y = y.to(out_dtype or x.dtype)
    if not prenorm:
        return y
    residual_dtype = residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)
    return y, h.to(residual_dtype)


def rms_norm_fn(x, weight, bias, residual=None, x1=None, weight1=None, bias1=None, eps=1e-6, dropout_p=0.0,
                rowscale=None, prenorm=False, residual_in_fp32=False, zero_centered_weight=False,
                return_dropout_mask=False, out_dtype=None, out=None, residual_out=None):
    return layer_norm_fn(x, weight, bias, residual, x1, weight1, bias1, eps, dropout_p, rowscale, prenorm,
                         residual_in_fp32, zero_centered_weight, True, return_dropout_mask, out_dtype)
