"""TEST-ONLY: run nanotron MAIN (the SmolLM3 code: Qwen2ForTraining, nn/moe.py, DistributedTrainer) on CPU/gloo.

Builds on tests/nanotron_cpu.py (the nanotron 0.4 CPU setup: flash-attn double, gloo, P2P and `device="cuda"`
literals on cpu; its trainer part is always installed here) and adds what main needs besides:
- `grouped_gemm.ops`: main imports it through nanotron.nn.moe, which nanotron.scaling imports, so even a dense model
  needs it; the real one is CUDA-only -> tests/grouped_gemm_double (first on sys.path).
- the rotary kernel double writes `inplace=True` results with a torch in-place op, which bumps autograd's version
  counter; main rotates q and kv in place as two views of one packed qkv tensor, so under grad autograd refuses.
  The real Triton kernel writes behind autograd's back: the wrapper writes into `x.data` (same values).
- torch.cuda.current_device -> "cpu" (main's MemoryBuffer allocates on it).
- main's timers: a "cuda" timer without CUDA turns itself into a CPU timer and the trainer asks for a "cuda" one
  again each step ("already exists with different settings") -> "cuda" timers are CPU timers when CUDA is absent.
- version skew, not CUDA: main passes `pos_idx_in_fp32` positionally to flash-attn's RotaryEmbedding, which
  flash-attn 2.7 removed (main pins < 2.7, the project runs 2.8.3) -> the same fields set by keyword.
- `fix_pp=True` (opt-in): nanotron main's own pipeline-parallel bugs, which make pp > 1 impossible upstream:
  (a) Qwen2Model.forward calls `position_ids.numel()` on a TensorPointer off the first stage; (b) PipelineBlock
  asserts on the `cu_seqlens=None` those stages then pass (a None input is passed through as a TensorPointer to the
  computing rank instead); (c) the trainer calls `loss_avg.item()` with loss_avg None off the last stage (logs NaN).
  nano_eval must refuse pp > 1 on an unfixed main (tests check that) and run it on a fixed one.
Call `install()` before nanotron's model or trainer modules are imported, in every process. nano_eval never imports
this module.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

GROUPED_GEMM_DOUBLE = str(Path(__file__).resolve().parent / "grouped_gemm_double")
_DONE: set[str] = set()


def is_main() -> bool:
    """Whether the importable nanotron is main (has models/qwen.py), without importing it."""
    from nano_eval.compat.nanotron import has_qwen2

    return has_qwen2()


def install(fix_pp: bool = False) -> None:
    """Idempotent; `fix_pp` adds the upstream pipeline-parallel fixes (see the module docstring)."""
    if "main" not in _DONE:
        _install_main()
        _DONE.add("main")
    if fix_pp and "pp" not in _DONE:
        _fix_pp()
        _DONE.add("pp")


def _install_main() -> None:
    import torch

    from tests.flash_attn_cpu import install as install_flash_attn

    install_flash_attn()
    if GROUPED_GEMM_DOUBLE not in sys.path:
        sys.path.insert(0, GROUPED_GEMM_DOUBLE)
    import grouped_gemm.ops

    if not grouped_gemm.ops.__file__.startswith(GROUPED_GEMM_DOUBLE):
        raise RuntimeError(f"expected the grouped_gemm test double, got {grouped_gemm.ops.__file__}")
    _rotary_inplace_behind_autograd()
    _rotary_keyword_init()
    from tests.nanotron_cpu import install as install_04_setup

    install_04_setup(trainer=True)
    torch.cuda.current_device = lambda: "cpu"
    from nanotron.logging.timers import TimerType, Timers

    timers_call = Timers.__call__

    @functools.wraps(timers_call)
    def cpu_timers(self, name, timer_type=TimerType.CUDA, *args, **kwargs):
        if not torch.cuda.is_available() and timer_type in ("cuda", TimerType.CUDA):
            timer_type = TimerType.CPU
        return timers_call(self, name, timer_type, *args, **kwargs)

    Timers.__call__ = cpu_timers


def _rotary_inplace_behind_autograd() -> None:
    import flash_attn.layers.rotary as layers_rotary

    kernels = sys.modules["flash_attn.ops.triton.rotary"]
    double = kernels.apply_rotary

    @functools.wraps(double)
    def apply_rotary(x, *args, inplace=False, **kwargs):
        if not inplace:
            return double(x, *args, inplace=False, **kwargs)
        double(x.data, *args, inplace=True, **kwargs)
        return x

    kernels.apply_rotary = layers_rotary.apply_rotary = apply_rotary


def _rotary_keyword_init() -> None:
    import inspect

    from flash_attn.layers.rotary import RotaryEmbedding

    if "pos_idx_in_fp32" in inspect.signature(RotaryEmbedding.__init__).parameters:
        return
    from nano_eval.compat.nanotron import import_nanotron

    import_nanotron()
    from nanotron.nn import rotary

    def init(self, dim, base=10000.0, interleaved=False, scale_base=None, pos_idx_in_fp32=True, device=None,
             seq_len_interpolation_factor=None):
        RotaryEmbedding.__init__(self, dim, base=base, interleaved=interleaved, scale_base=scale_base, device=device)
        self.pos_idx_in_fp32 = pos_idx_in_fp32  # nanotron's _update_cos_sin_cache reads both
        self.seq_len_interpolation_factor = seq_len_interpolation_factor

    rotary.FlashRotaryEmbedding.__init__ = init


def _fix_pp() -> None:
    import torch

    import nanotron.distributed as ntdist
    import nanotron.trainer as nt_trainer
    from nanotron.parallel.pipeline_parallel.block import PipelineBlock
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    TensorPointer.numel = lambda self: 0  # (a): those stages skip computing cu_seqlens
    block_forward = PipelineBlock.forward

    @functools.wraps(block_forward)
    def forward(self, **kwargs):  # (b)
        if ntdist.get_rank(self.p2p.pg) != self.rank:
            kwargs = {k: TensorPointer(group_rank=self.rank) if v is None else v for k, v in kwargs.items()}
        return block_forward(self, **kwargs)

    PipelineBlock.forward = forward
    step_logs = nt_trainer.DistributedTrainer.train_step_logs

    @functools.wraps(step_logs)
    def train_step_logs(self, outputs, loss_avg, *args, **kwargs):  # (c)
        return step_logs(self, outputs, torch.tensor(float("nan")) if loss_avg is None else loss_avg, *args, **kwargs)

    nt_trainer.DistributedTrainer.train_step_logs = train_step_logs
