"""TEST-ONLY: run nanotron 0.4's real model and trainer on a CPU-only torch under gloo.

nanotron imports flash-attn's kernels and writes `device="cuda"` in a few places. `install()` imports the real
flash-attn package with test doubles for its compiled kernels (tests/flash_attn_cpu.py) and patches those CUDA-only
spots; it must run before nanotron's model or trainer modules are imported, in every test process (spawned ranks call
it, torchrun workers go through tests/nanotron_cpu_launch.py). nano_eval itself never imports this module.

Patched (each is a CUDA literal or CUDA-only call, not model math):
- ParallelContext.set_device and nanotron.distributed.initialize_torch_distributed (CUDA-only) -> gloo
- P2P(..., device="cuda") buffers in LlamaModel, build_model's default device -> cpu
- llama RotaryEmbedding.init_rotary_embeddings (freqs buffer on "cuda") -> same values on cpu
- torch.cuda.synchronize / reset_peak_memory_stats -> no-ops
- with trainer=True: every remaining `device="cuda"` / `.to("cuda")` in nanotron's trainer, optimizer, dataloader
  and checkpoint code -> cpu (a TorchFunctionMode entered for the whole process); broadcast_object_list's cuda
  device; torch.Generator(device="cuda") in the dummy data generator; all_reduce(AVG) on parameters under gloo
  (gloo divides in place on a leaf that requires grad) -> SUM then divide under no_grad.
"""

from __future__ import annotations

import functools

from tests.flash_attn_cpu import install as install_flash_attn

_DONE: set[str] = set()


def install(trainer: bool = False) -> None:
    """Idempotent; `trainer=True` also patches what DistributedTrainer needs."""
    if "model" not in _DONE:
        _patch_model()
        _DONE.add("model")
    if trainer and "trainer" not in _DONE:
        _patch_trainer()
        _DONE.add("trainer")


def _is_cuda(device) -> bool:
    import torch

    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda")


def _patch_model() -> None:
    install_flash_attn()
    import torch

    from nano_eval.compat.nanotron import import_nanotron

    import_nanotron()
    import nanotron.distributed as ntdist
    import nanotron.models.base as base
    import nanotron.models.llama as llama
    from nanotron.parallel.context import ParallelContext
    from nanotron.parallel.pipeline_parallel import p2p

    ParallelContext.set_device = lambda self: None

    def initialize_torch_distributed():
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo")
        return True

    ntdist.initialize_torch_distributed = initialize_torch_distributed

    p2p_init = p2p.P2P.__init__

    @functools.wraps(p2p_init)
    def cpu_p2p_init(self, pg, device):
        p2p_init(self, pg, torch.device("cpu"))

    p2p.P2P.__init__ = cpu_p2p_init
    defaults = list(base.build_model.__defaults__)
    defaults[-1] = torch.device("cpu")
    base.build_model.__defaults__ = tuple(defaults)

    def init_rotary_embeddings(self):  # nanotron's formula, on cpu
        if self._initialized_buffer:
            return
        inv = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float)[: self.dim // 2] / self.dim))
        angles = torch.outer(torch.arange(self.end), inv).float()
        freqs = torch.view_as_real(torch.polar(torch.ones_like(angles), angles))
        self.register_buffer("freqs_cis", freqs, persistent=False)
        self._initialized_buffer = True

    llama.RotaryEmbedding.init_rotary_embeddings = init_rotary_embeddings
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.reset_peak_memory_stats = lambda *a, **k: None


class _CudaLiteralsToCpu(__import__("torch").overrides.TorchFunctionMode):
    """`device="cuda"` keyword, `.to("cuda")` and `.cuda()` on any torch call -> cpu."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import torch

        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": torch.device("cpu")}
        if func is torch.Tensor.to and any(_is_cuda(a) for a in args[1:]):
            args = tuple(torch.device("cpu") if i and _is_cuda(a) else a for i, a in enumerate(args))
        elif func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


def _patch_trainer() -> None:
    import types

    import torch
    import torch.distributed as tdist

    import nanotron.distributed as ntdist

    try:
        import nanotron.dataloader as dataloader  # nanotron 0.4
    except ImportError:
        import nanotron.data.dataloader as dataloader  # nanotron main moved it

    _CudaLiteralsToCpu().__enter__()  # for the rest of this (test) process

    broadcast_object_list = tdist.broadcast_object_list

    def cpu_broadcast_object_list(objects, src=None, group=None, device=None, **kw):
        return broadcast_object_list(objects, src=src, group=group, device=None if _is_cuda(device) else device, **kw)

    ntdist.broadcast_object_list = cpu_broadcast_object_list

    proxy = types.ModuleType("torch")  # nanotron.dataloader's `torch`, with a Generator that ignores "cuda"
    proxy.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    proxy.Generator = lambda device="cpu": torch.Generator(device="cpu" if _is_cuda(device) else device)
    dataloader.torch = proxy

    all_reduce = ntdist.all_reduce

    @functools.wraps(all_reduce)
    def gloo_all_reduce(tensor, op=tdist.ReduceOp.SUM, group=None, async_op=False):
        if op != tdist.ReduceOp.AVG:
            return all_reduce(tensor, op=op, group=group, async_op=async_op)
        all_reduce(tensor, op=tdist.ReduceOp.SUM, group=group)
        with torch.no_grad():
            tensor.div_(tdist.get_world_size(group))
        return _Done() if async_op else None

    ntdist.all_reduce = gloo_all_reduce


class _Done:
    def wait(self, *a, **k):
        return True

    def is_completed(self):
        return True
