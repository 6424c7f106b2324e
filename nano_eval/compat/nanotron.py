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
- nanotron main's Qwen2 under context parallelism (cp > 1, ring attention): `LocalAttention` switches the ring off
  while nano_eval scores, so each CP rank scores whole rows as a data-parallel rank.
"""

from __future__ import annotations

import os
import re
import sys
import types
from contextlib import contextmanager

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


RING_ATTENTION = "llama3_ring_attention"


class LocalAttention:
    """Context parallelism folded into data parallelism while scoring a nanotron main Qwen2Model (cp > 1).

    How main's Qwen2 runs CP (models/qwen.py, 2411b022): every rank holds S/cp tokens of each row with the row's
    GLOBAL position ids; each Qwen2Attention takes its local length as `position_ids.shape[1] // cp_pg_size`, its
    RoPE offset as `rank(cp_pg) * local length`, and, when `config._attn_implementation` is
    "llama3_ring_attention", rings keys/values over cp_pg (Qwen2Model.forward prepares the ring's cu_seqlens from
    the same config field). While `applied()`: every attention module's `cp_pg_size` is 1 and its `cp_pg` a group of
    this rank alone (RoPE offset 0), and the config says plain flash attention, so each CP rank runs whole rows by
    itself, exactly as a cp=1 model does; the results gather then spans dp x cp (`parallel_context.dp_cp_pg`).
    Everything is restored on exit (the same objects), so training resumes unchanged.

    Build it on EVERY rank of the world (the solo groups come from nanotron's collective `create_new_group`,
    cached in the ParallelContext: with expert parallelism 1 they already exist as its ep_pg groups)."""

    def __init__(self, model, parallel_context):
        world = parallel_context.world_pg.size()
        solo = parallel_context.create_new_group([[rank] for rank in range(world)])
        modules = list(model.modules())
        self.flips = [(m, "cp_pg", solo) for m in modules if getattr(m, "cp_pg", None) is parallel_context.cp_pg]
        self.flips += [(m, "cp_pg_size", 1) for m in modules if getattr(m, "cp_pg_size", 1) != 1]
        configs = {id(c): c for c in (getattr(m, "config", None) for m in modules) if c is not None}
        self.flips += [(c, "_attn_implementation", "flash_attention_2") for c in configs.values()
                       if getattr(c, "_attn_implementation", None) == RING_ATTENTION]

    @contextmanager
    def applied(self):
        """CP off inside (see the class), everything as it was after."""
        saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in self.flips]
        try:
            for obj, attr, value in self.flips:
                setattr(obj, attr, value)
            yield
        finally:
            for obj, attr, value in reversed(saved):
                setattr(obj, attr, value)
