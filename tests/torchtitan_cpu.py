"""TEST DOUBLE (tests only, never imported by nano_eval): torchtitan 0.3.0 on a machine without a GPU.

What cannot exist here and what stands in for it:
- torchtitan picks its device type once, at import (`torchtitan.tools.utils.device_type`: "cuda" when no accelerator
  is found) and several modules copy the name; `install()` sets "cpu" / `torch.cpu` in every torchtitan module that
  holds them, so DeviceMesh, the gloo process group and `init_states` run on CPU.
- FlexAttention is `torch.compile`d by default (inductor kernels: Triton on GPU; on CPU a C++ toolchain and minutes
  on 2 cores): `install()` runs `create_block_mask` eagerly and `flex_attention` eagerly too (the same maths,
  unfused) wherever no gradient is needed (every evaluation forward). torch has no CPU backward for flex attention,
  so a training forward goes through `_masked_attention`: the BlockMask's own mask_mod made dense, then softmax
  attention in plain torch ops (autograd works); it is checked against eager flex_attention (`check_double`).


- torchtitan asks its device module for what `torch.cpu` does not have (a device index for `barrier(device_ids=)`,
  a name, capacity and peak memory statistics for its memory monitor): `_CpuDeviceModule` is `torch.cpu` plus
  those, answering with index 0, the machine's memory and zero peaks (metrics only).

- gloo has no `ReduceOp.PREMUL_SUM`, which FSDP2 picks for its gradient reduce-scatter once torchtitan sets the
  gradient divide factor to 1: on CPU FSDP2 is told to reduce with SUM and divide itself, as it does for MTIA
  (`_get_gradient_divide_factors`: same gradients).

- not CPU but the project's torch (2.13), which is older than torchtitan 0.3.0's (its spmd_types backend and a few
  calls need torch >= 2.15, a multi-GB CUDA wheel): `torch.distributed.set_timeout(timeout, group)`, called after
  the first step, is torch 2.13's `distributed_c10d._set_pg_timeout`; pipeline schedules' `step(arg_mbs=,
  kwarg_mbs=, target_mbs=)` (microbatches split by the caller, newer torch) runs torch 2.13's own
  `_step_microbatches` on them (`_schedule_step_with_microbatches`).

Everything else (Trainer, parallelize_llama, FSDP2, TP, pipeline_llm, DCP checkpointer, data loader, tokenizer) is
torchtitan's real code.
"""

from __future__ import annotations

import sys

import torch


def install() -> None:
    """Call in each process before torchtitan builds anything (it imports torchtitan's modules first)."""
    import torchtitan.components.metrics  # noqa: F401  (import the modules that copy device_type, then fix them)
    import torchtitan.distributed.parallel_dims  # noqa: F401
    import torchtitan.distributed.pipeline_parallel  # noqa: F401
    import torchtitan.distributed.utils  # noqa: F401
    import torchtitan.models  # noqa: F401
    import torchtitan.tools.utils as tu
    import torchtitan.trainer  # noqa: F401

    cpu_module = _CpuDeviceModule()
    tu.device_type, tu.device_module = "cpu", cpu_module
    for name, module in list(sys.modules.items()):
        if not name.startswith("torchtitan") or module is None:
            continue
        if getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if getattr(module, "device_module", None) is torch.cuda:
            module.device_module = cpu_module
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    divide_factors = _fsdp_collectives._get_gradient_divide_factors
    if not getattr(divide_factors, "_cpu_double", False):
        def sum_on_cpu(*args, **kwargs):
            if kwargs.get("device_type", args[3] if len(args) > 3 else "") == "cpu":
                args, kwargs = args[:5], {**kwargs, "force_sum_reduction_for_comms": True}
            return divide_factors(*args, **kwargs)

        sum_on_cpu._cpu_double = True
        _fsdp_collectives._get_gradient_divide_factors = sum_on_cpu
    import torch.distributed as dist

    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)
    from torch.distributed.pipelining import schedules

    for cls in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if not getattr(cls.step, "_cpu_double", False):
            cls.step = _schedule_step_with_microbatches(cls.step)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import torchtitan.models.common.attention as attention

    def flex_or_double(q, k, v, **kwargs):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return _masked_attention(q, k, v, **kwargs)
        return flex_attention(q, k, v, **kwargs)

    attention.FlexAttention._compiled_flex_attn = staticmethod(flex_or_double)
    attention._compiled_create_block_mask = create_block_mask


class _CpuDeviceModule:
    """`torch.cpu` plus what torchtitan asks a device module for that it lacks (see the module docstring)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def get_device_properties(device=None):
        import os
        from types import SimpleNamespace

        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), name="cpu")

    @staticmethod
    def synchronize(device=None) -> None:
        pass

    @staticmethod
    def memory_stats(device=None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


def _masked_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
                      kernel_options=None):
    """flex_attention's maths for q [B, N, L, E], k / v [B, N_kv, S, E] under `block_mask` (no score_mod), in
    differentiable torch ops: (out [B, N, L, E], aux with .lse [B, N, L] when asked)."""
    from types import SimpleNamespace

    from torch.nn.attention.flex_attention import create_mask

    assert score_mod is None, "the CPU double implements masks only"
    b, n, length, e = q.shape
    if enable_gqa and k.shape[1] != n:
        k = k.repeat_interleave(n // k.shape[1], dim=1)
        v = v.repeat_interleave(n // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * (e ** -0.5 if scale is None else scale)
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, b, None, length, k.shape[2], device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)
    out = (torch.softmax(scores.float(), dim=-1).to(q.dtype)) @ v
    lse_wanted = return_aux is not None and getattr(return_aux, "lse", False)
    return out, SimpleNamespace(lse=lse if lse_wanted else None, max_scores=None)


def check_double(seed: int = 0) -> float:
    """Largest |difference| between `_masked_attention` and eager flex_attention on a packed-document mask."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 40, 8, generator=g) for _ in range(3))
    starts = torch.tensor([[0, 0, 0] + [0] * 37, [0] * 40])
    starts[0, 17] = 1  # a second document from position 17 in row 0
    doc = starts.cumsum(dim=1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    block = create_block_mask(mask_mod, 2, None, 40, 40, device="cpu")
    want, aux = flex_attention(q, k, v, block_mask=block, return_aux=AuxRequest(lse=True))
    got, got_aux = _masked_attention(q, k, v, block_mask=block, return_aux=AuxRequest(lse=True))
    return max((want - got).abs().max().item(), (aux.lse - got_aux.lse).abs().max().item())


def _schedule_step_with_microbatches(step):
    """torch 2.13's schedule.step(*args, **kwargs) plus newer torch's keyword form `step(arg_mbs=, kwarg_mbs=,
    target_mbs=, losses=, return_outputs=, loss_kwargs=)` (microbatches already split): the same per-iteration
    set-up as torch 2.13's own step, then its `_step_microbatches` on the given microbatches."""
    import functools

    @functools.wraps(step)
    def stepped(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(self, *args, **kwargs)
        losses, return_outputs = kwargs.pop("losses", None), kwargs.pop("return_outputs", True)
        loss_kwargs = kwargs.pop("loss_kwargs", None)
        assert not args and not kwargs, (args, kwargs)
        stages = list(getattr(self, "_stages", None) or [self._stage])
        for stage in stages:
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        for stage in stages:
            if stage.is_last and return_outputs:
                return self._merge_outputs(stage.output_chunks)
        return None

    stepped._cpu_double = True
    return stepped
