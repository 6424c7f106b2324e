"""TEST DOUBLE (tests only; the product never imports it): megatron-core 0.16 on a CPU-only torch build.

megatron-core's GPTModel, pipeline schedules, DistributedDataParallel and optimizer are plain torch plus a handful
of CUDA-only calls that a CPU build cannot answer. `install()` answers them, in the spawned test process only:

- device literals: `device="cuda"`, `torch.device("cuda")`, `torch.cuda.current_device()`, `tensor.cuda()`,
  `tensor.to("cuda")` and `pin_memory=True` become CPU (schedules' token counters, P2P receive buffers, the grad
  buffers of DDP, the optimizer's found-inf flag, grad clipping's norms, RoPE's frequencies, the causal mask);
- type checks: `tensor.type()` reports a CPU float tensor as `torch.cuda.FloatTensor`, the only types the
  optimizer, the distributed optimizer and grad clipping accept;
- streams and synchronisation: `torch.cuda.synchronize` / `empty_cache` do nothing, `current_stream()` /
  `default_stream()` return a stream whose waits do nothing (CPU ops are synchronous);
- RNG: the "CUDA" generator of megatron's `CudaRNGStatesTracker` (model-parallel seeds, `fork()` for init and
  dropout) is the CPU default generator, as on a GPU it is the device's default generator. Deterministic, but not
  bitwise equal to a GPU run.
- Apex's FusedRMSNorm (a CUDA kernel): megatron's local layer spec falls back to `WrappedTorchNorm`, which refuses
  sequence parallelism; `local_spec_norm()` gives a torch RMSNorm that megatron's spec accepts in its place.
- Mixture-of-Experts token dispatchers: `torch.cuda.Stream()` / `Event()` (the alltoall dispatcher's side stream
  for its device-to-host copies of the split sizes) are the same do-nothing stream and an always-done event;
  `moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)` hands back a numpy array for a CPU tensor too, as it does
  for a CUDA one (torch.distributed's all_to_all_single takes the split sizes as a list-like, not a tensor); and
  the Transformer Engine names megatron-core 0.16.1's moe_utils reads unguarded (`te_general_gemm`, the fused
  permute / router kernels) are bound to None where Transformer Engine is not installed (a NameError otherwise).
- the fused-softmax CUDA extensions megatron-core's FusedScaleMaskSoftmax imports (`scaled_upper_triang_masked_softmax_cuda`,
  `scaled_masked_softmax_cuda`, `scaled_softmax_cuda`, built by Apex / Megatron-LM): tests/megatron_kernels/ goes
  first on sys.path, torch implementations with the kernels' semantics (the upper-triangular one takes no mask), so
  with fp16/bf16 and `masked_softmax_fusion=True` megatron-core's own kernel selection runs and picks them.

Everything is patched once per process and never undone: call `install()` first thing in a spawned worker, never in
the pytest process itself (the product's own CPU code paths must keep running unpatched there).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")
KERNELS_DIR = str(Path(__file__).resolve().parent / "megatron_kernels")
_installed = False


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaLiteralsToCpu(TorchFunctionMode):
    """Rewrites the CUDA device arguments of every torch call; reports CPU tensors under CUDA type names."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # e.g. "torch.FloatTensor" -> "torch.cuda.FloatTensor"
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = CPU
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


class _SyncStream:
    """torch.cuda.Stream stand-in: CPU work is already in order, so every wait is a no-op."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def record_event(self, *args, **kwargs):
        return _DoneEvent()

    def synchronize(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _DoneEvent:
    """torch.cuda.Event stand-in: recorded work on CPU is already done."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def wait(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


def _patch_torch_cuda() -> None:
    cuda, stream = torch.cuda, _SyncStream()
    cuda.current_device = lambda: CPU
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda *a, **k: None
    cuda.current_stream = lambda *a, **k: stream
    cuda.default_stream = lambda *a, **k: stream
    cuda.stream = lambda *a, **k: stream
    cuda.Stream, cuda.Event = _SyncStream, _DoneEvent  # classes: annotations like `torch.cuda.Stream | None` hold
    # the "CUDA" generator is the CPU default generator (torch.manual_seed calls cuda.manual_seed_all: keep it inert)
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self  # module.cuda() applies this to every parameter


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *a, clone=False, **k: (
        torch.get_rng_state().clone() if clone else torch.get_rng_state())
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # fork() checks that the CPU generator did not move inside it; here it is the same generator: silence that
    logging.getLogger(megatron_random.__name__).setLevel(logging.ERROR)


def _patch_megatron_moe() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    for name in ("te_general_gemm", "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute"):
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def install() -> None:
    """Patch torch.cuda and megatron-core's RNG helpers, put the fused-softmax doubles on sys.path, and rewrite CUDA
    literals from now on (idempotent)."""
    global _installed
    if _installed:
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # megatron checks it before overlapping comms
    if KERNELS_DIR not in sys.path:
        sys.path.insert(0, KERNELS_DIR)
    _patch_torch_cuda()
    _patch_megatron_rng()
    _patch_megatron_moe()
    _CudaLiteralsToCpu().__enter__()  # stays active for the life of the process
    _installed = True


def local_spec_norm():
    """A norm class for megatron's local layer spec that, unlike its WrappedTorchNorm, accepts sequence parallelism
    (stands in for Apex's FusedRMSNorm). Same maths as WrappedTorchNorm's RMSNorm: torch.nn.RMSNorm."""
    class RMSNorm(torch.nn.RMSNorm):
        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
            super().__init__(hidden_size, eps=eps)
            for p in self.parameters():  # megatron all-reduces sequence-parallel norm grads by this flag
                p.sequence_parallel = config.sequence_parallel

    return RMSNorm
