"""Everything nano_eval needs to know about nanotron's versions, in one module.

- nanotron 0.4 (PyPI) cannot be imported as is: `nanotron.logging` imports `nanotron.config.config`, whose import
  chain reaches `nanotron.parallel.pipeline_parallel.engine`, which imports `nanotron.logging` again (upstream
  issues 191 and 235). We import `nanotron.logging` against a placeholder config module (it only uses
  `LoggingArgs` in a type hint), then import the real config.
- `ParallelContext.set_device` calls CUDA; `CPUParallelContext` skips it so the parallel modules run on gloo.
- Two model contracts (`model_family`): nanotron's LlamaModel (0.4 and main) takes `input_ids, input_mask`
  `[B, S]` and returns logits `[S, B, V/tp]`; nanotron main's Qwen2Model takes `input_ids` and FLAT-viewable
  `position_ids` `[B, S]` (it calls `.view(-1)`, so no stride-0 expand), starts a new document (its own causal
  attention span, `cu_seqlens`) wherever a position is 0, and returns logits `[B * S, V/tp]`.
- nanotron main (2411b022) cannot run a Qwen2 forward with pp > 1: `Qwen2Model.forward` calls
  `position_ids.numel()` on every stage, a TensorPointer (no `numel`) off the first one (`qwen2_pp_bug`).
- Under numpy >= 2, nanotron 0.4's `save_weights` writes the unsharded shape of chunked column linears (Llama's
  qkv_proj, gate_up_proj) as "(np.int64(192), 64)", which its own metadata parser cannot read, so `load_weights`
  fails whenever it must reshard. We teach the parser to read those strings (reading only; files are unchanged).
- nanotron 0.4 requires `flash-attn>=2.5.0`, so a fresh install gets 2.8.x, whose `bert_padding.unpad_input`
  returns 5 values (2.6 added the used lengths); the Llama inference path (its KV-cache prefill) unpacks 4.
  `four_value_unpad_input` gives nanotron's Llama module an `unpad_input` that returns the first 4 (flash-attn 2.5
  returns exactly those), leaving flash-attn's own module untouched.
"""

from __future__ import annotations

import os
import re
import sys
import types

from nano_eval.errors import NanoEvalError

_READY = False


def import_nanotron():
    """Import nanotron once, working around the 0.4 import cycle; returns the `nanotron` module."""
    global _READY
    try:
        import nanotron
    except ImportError as e:
        raise NanoEvalError("nanotron is not installed. Fix: pip install -e '.[nanotron]' in the nano_eval checkout "
                            "(nanotron==0.4).") from e
    if _READY or "nanotron.logging" in sys.modules:
        _READY = True
        return nanotron
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # nanotron asserts it for TP comm/compute overlap
    placeholder_pkg = types.ModuleType("nanotron.config")
    placeholder_pkg.__path__ = []  # a package, so `nanotron.config.config` resolves to the placeholder below
    placeholder = types.ModuleType("nanotron.config.config")
    placeholder.LoggingArgs = type("LoggingArgs", (), {})
    saved = {name: sys.modules.get(name) for name in ("nanotron.config", "nanotron.config.config")}
    sys.modules.update({"nanotron.config": placeholder_pkg, "nanotron.config.config": placeholder})
    try:
        import nanotron.logging  # noqa: F401
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    import nanotron.config  # noqa: F401  (the real one, now that nanotron.logging is complete)

    _read_numpy2_shape_metadata()
    _READY = True
    return nanotron


NUMPY_SCALAR_REPR = re.compile(r"np\.\w+\((-?\d+)\)")  # "np.int64(192)" as numpy 2 prints it


def _read_numpy2_shape_metadata() -> None:
    """Let nanotron's TensorMetadata parse "(np.int64(192), 64)" as (192, 64)."""
    from nanotron.serialize.metadata import TensorMetadata

    original = TensorMetadata.from_str_dict.__func__
    if getattr(original, "_nano_eval_patched", False):
        return

    def from_str_dict(cls, dictionary):
        if "unsharded_shape" in dictionary:
            dictionary = {**dictionary, "unsharded_shape": NUMPY_SCALAR_REPR.sub(r"\1", dictionary["unsharded_shape"])}
        return original(cls, dictionary)

    from_str_dict._nano_eval_patched = True
    TensorMetadata.from_str_dict = classmethod(from_str_dict)


def four_value_unpad_input(llama=None) -> None:
    """Let nanotron's Llama inference path work with flash-attn 2.5 through 2.8 (see the module docstring):
    `llama.bert_padding` (default: nanotron.models.llama's) becomes a copy of flash-attn's module whose `unpad_input`
    returns (unpadded, indices, cu_seqlens, max_seqlen). Idempotent; only nanotron's reference changes."""
    if llama is None:
        import nanotron.models.llama as llama

    padding = llama.bert_padding
    if getattr(padding, "_nano_eval_four_values", False):
        return
    original = padding.unpad_input

    def unpad_input(hidden_states, attention_mask, *args, **kwargs):
        return tuple(original(hidden_states, attention_mask, *args, **kwargs))[:4]

    adapted = types.ModuleType(padding.__name__, padding.__doc__)
    adapted.__dict__.update({k: v for k, v in vars(padding).items() if not k.startswith("__")})
    adapted.unpad_input, adapted._nano_eval_four_values = unpad_input, True
    llama.bert_padding = adapted


def cpu_parallel_context(tp: int, pp: int, dp: int):
    """A nanotron ParallelContext for CPU/gloo: torch.distributed must already be initialised."""
    import_nanotron()
    from nanotron.parallel import ParallelContext

    class CPUParallelContext(ParallelContext):
        def set_device(self):  # ParallelContext pins a CUDA device; there is none here
            pass

    return CPUParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)


LLAMA, QWEN2 = "llama", "qwen2"


def model_family(model) -> str | None:
    """LLAMA or QWEN2 for nanotron's own LlamaModel / Qwen2Model (subclasses included); None for anything else.
    Looks only at modules already imported (the model's own), so it never imports nanotron main's Qwen2."""
    families = ((LLAMA, "nanotron.models.llama", "LlamaModel"), (QWEN2, "nanotron.models.qwen", "Qwen2Model"))
    for family, module_name, class_name in families:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is not None and isinstance(model, cls):
            return family
    return None


def model_inputs(family: str, input_ids, position_ids) -> dict:
    """The keyword arguments of the model's `forward` (see the module docstring): Llama gets an all-true mask,
    Qwen2 contiguous position ids (each row of `position_ids` starts at 0, so each row is its own document)."""
    import torch

    if family == QWEN2:
        ids = position_ids if not isinstance(position_ids, torch.Tensor) else position_ids.contiguous()
        return {"input_ids": input_ids, "position_ids": ids}
    mask = torch.ones_like(input_ids, dtype=torch.bool) if isinstance(input_ids, torch.Tensor) else input_ids
    return {"input_ids": input_ids, "input_mask": mask}


def has_qwen2() -> bool:
    """Whether the installed nanotron has main's Qwen2 (models/qwen.py), without importing nanotron."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("nanotron")
    return spec is not None and any((Path(p) / "models" / "qwen.py").is_file()
                                    for p in spec.submodule_search_locations or ())


def qwen2_pp_bug() -> bool:
    """Whether this nanotron's Qwen2Model fails off the first pipeline stage (upstream bug of main 2411b022:
    `position_ids.numel()` on a TensorPointer, which has no `numel`)."""
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    return not hasattr(TensorPointer, "numel")
