"""The fused-softmax CUDA extensions' test doubles (tests/megatron_kernels/) against softmax written out here, and
megatron-core's own FusedScaleMaskSoftmax selecting them (what makes its fused path reachable on CPU)."""

import importlib.util
import sys

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

import torch  # noqa: E402

from tests.megatron_cpu import KERNELS_DIR  # noqa: E402

NAMES = ("fused_softmax_double", "scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
         "scaled_softmax_cuda")


@pytest.fixture
def kernels(monkeypatch):
    """The doubles imported under their extension names for this test only (the pytest process otherwise never
    has them: megatron_cpu.install() puts them on sys.path in spawned workers)."""
    modules = {}
    for name in NAMES:
        spec = importlib.util.spec_from_file_location(name, f"{KERNELS_DIR}/{name}.py")
        modules[name] = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, modules[name])
        spec.loader.exec_module(modules[name])
    return modules


def naive(scores, scale, masked):
    """Row-by-row softmax of scale * scores in float64 over the unmasked keys (zeros where all are masked)."""
    out = torch.zeros(scores.shape, dtype=torch.float64)
    flat, flat_mask, flat_out = scores.reshape(-1, scores.shape[-1]), masked.reshape(-1, scores.shape[-1]), out.view(-1, scores.shape[-1])
    for i in range(flat.shape[0]):
        keep = ~flat_mask[i]
        if keep.any():
            flat_out[i, keep] = torch.softmax(flat[i, keep].double() * scale, dim=-1)
    return out


def test_upper_triangular_kernel_is_causal_and_takes_no_mask(kernels):
    torch.manual_seed(0)
    x = torch.randn(8, 20, 20).bfloat16()
    y = kernels["scaled_upper_triang_masked_softmax_cuda"].forward(x, 0.5)
    assert y.dtype == torch.bfloat16
    causal = torch.ones(20, 20, dtype=torch.bool).triu(1).expand(8, 20, 20)
    torch.testing.assert_close(y.double(), naive(x, 0.5, causal), atol=4e-3, rtol=1e-2)
    with pytest.raises(RuntimeError, match="fp16 and bf16"):
        kernels["scaled_upper_triang_masked_softmax_cuda"].forward(x.float(), 0.5)


def test_masked_kernel_applies_a_per_row_mask_and_zeros_fully_masked_rows(kernels):
    torch.manual_seed(1)
    x = torch.randn(2, 4, 24, 24).half()
    mask = torch.rand(2, 1, 24, 24) < 0.3
    mask[1, 0, 5] = True  # a query that sees nothing
    y = kernels["scaled_masked_softmax_cuda"].forward(x, mask, 1.0)
    torch.testing.assert_close(y.double(), naive(x, 1.0, mask.expand(2, 4, 24, 24)), atol=2e-3, rtol=1e-2)
    assert not y[1, :, 5].any()
    assert kernels["scaled_masked_softmax_cuda"].get_batch_per_block(24, 24, 2, 4) == 8  # 32-thread warps, 2 rows
    assert kernels["scaled_masked_softmax_cuda"].get_batch_per_block(200, 200, 2, 4) == 4  # 256 keys: 1 row a warp


def test_backward_is_the_softmax_jacobian(kernels):
    torch.manual_seed(2)
    x = torch.randn(4, 6, 20, dtype=torch.float64, requires_grad=True)
    y = torch.softmax(x * 0.7, dim=-1)
    dy = torch.randn_like(y)
    (expected,) = torch.autograd.grad(y, x, dy)
    got = kernels["scaled_softmax_cuda"].backward(dy.float(), y.detach().float(), 0.7)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-4)


def test_fused_scale_mask_softmax_picks_the_kernels_by_megatrons_own_rules(kernels):
    """megatron-core's selection: bf16, fusion on, sk in 17..4096, sq and sk divisible by 4, rows x heads divisible by
    the kernel's rows per block -> the fused kernel; a causal layer then drops the mask it is given (the fault the
    Megatron KV-cache decoder avoids by declaring a padding mask), a padding-type layer applies it."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.utils import attention_mask_func

    torch.manual_seed(3)
    x = torch.randn(2, 4, 24, 24).bfloat16()
    padding = torch.ones(24, 24, dtype=torch.bool).triu(1)[None, None].repeat(2, 1, 1, 1)
    padding[1, :, :, :5] = True  # row 1: five left-padding columns
    calls = []
    for name in NAMES[1:]:
        forward = kernels[name].forward
        kernels[name].forward = lambda *a, _f=forward, _n=name: calls.append(_n) or _f(*a)

    def softmax(mask_type):
        return FusedScaleMaskSoftmax(False, True, mask_type, True, attention_mask_func, True, None)

    causal = softmax(AttnMaskType.causal)(x, padding)
    padded = softmax(AttnMaskType.padding)(x, padding)
    assert calls == ["scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda"]
    assert causal[1, :, 10, :5].float().sum() > 0.1  # the padding columns were attended to
    torch.testing.assert_close(padded.double(), naive(x, 1.0, padding.expand(2, 4, 24, 24)), atol=4e-3, rtol=1e-2)
    assert softmax(AttnMaskType.causal)(x[..., :20, :20], padding[..., :20, :20]) is not None
    assert len(calls) == 3  # 20 keys: 2 x 4 rows-x-heads divide by 8 -> fused again
    softmax(AttnMaskType.causal)(x[:1, :2], padding[:1])  # 1 x 2 rows-x-heads: torch's softmax
    assert len(calls) == 3
