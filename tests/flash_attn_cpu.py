"""TEST-ONLY: the real flash-attn Python package (2.8.3, installed by scripts/setup.sh without its CUDA build) on a
CPU-only machine, with test doubles for its compiled kernels only (tests/flash_attn_double/).

flash-attn's kernels are CUDA (`flash_attn_2_cuda`, a compiled extension) and Triton (`flash_attn.ops.triton.*`);
neither runs without a GPU. `install()` supplies them:
- `flash_attn_2_cuda`: tests/flash_attn_double/flash_attn_2_cuda.py, found first on sys.path;
- `flash_attn.ops.triton.rotary` and `flash_attn.ops.triton.layer_norm` (Triton kernel modules, the only ones
  nanotron reaches): tests/flash_attn_double/triton_rotary.py / triton_layer_norm.py, loaded under those names;
- flash-attn registers its kernel calls as torch custom ops for CUDA tensors only (`device_types="cuda"`): the same
  Python functions are registered for CPU tensors too.
Everything else, `flash_attn_interface` (argument handling, autograd), `bert_padding` (unpad_input returns 5 values
from 2.6 on) and `layers.rotary.RotaryEmbedding`, is flash-attn's own code. nano_eval itself never imports this.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DOUBLE_DIR = str(Path(__file__).resolve().parent / "flash_attn_double")
KERNEL_MODULES = {"flash_attn.ops.triton.rotary": "triton_rotary.py",
                  "flash_attn.ops.triton.layer_norm": "triton_layer_norm.py"}
CUDA_ONLY_OPS = ("_flash_attn_forward", "_flash_attn_varlen_forward", "_flash_attn_backward",
                 "_flash_attn_varlen_backward")


def install():
    """Import the real `flash_attn` with the kernel doubles in place (idempotent); returns the package."""
    if DOUBLE_DIR not in sys.path:
        sys.path.insert(0, DOUBLE_DIR)
    import flash_attn_2_cuda

    if not flash_attn_2_cuda.__file__.startswith(DOUBLE_DIR):
        raise RuntimeError(f"expected the flash_attn_2_cuda test double, got {flash_attn_2_cuda.__file__}")
    import flash_attn.ops.triton  # the real package (its __init__ imports flash_attn_interface -> the double above)

    for name, file in KERNEL_MODULES.items():
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, str(Path(DOUBLE_DIR) / file))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
            setattr(flash_attn.ops.triton, name.rsplit(".", 1)[1], module)
    import flash_attn.flash_attn_interface as interface

    for name in CUDA_ONLY_OPS:
        op = getattr(interface, name)
        if not getattr(op, "_nano_eval_cpu", False):
            op.register_kernel("cpu")(op._init_fn)  # the same Python function, for CPU tensors
            op._nano_eval_cpu = True
    return flash_attn


def uninstall() -> None:
    """Forget the imported modules and the sys.path entry (for the pytest process, which must not see flash-attn
    afterwards: other tests check what a machine without its kernels is told). The CPU registrations of flash-attn's
    custom ops stay (torch cannot drop them); importing flash_attn again in the same process is not supported."""
    if DOUBLE_DIR in sys.path:
        sys.path.remove(DOUBLE_DIR)
    for name in [m for m in sys.modules if m in ("flash_attn", "flash_attn_2_cuda") or m.startswith("flash_attn.")]:
        del sys.modules[name]
