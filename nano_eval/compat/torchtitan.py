"""What the torchtitan backend needs from torchtitan and from torch's FSDP2, in one place (tested: torchtitan 0.3.0
on torch 2.13, SPMD backend `partial_dtensor`).

- `layout_of(parallel_dims)`: nano_eval's ParallelLayout from torchtitan's `ParallelDims` meshes. The evaluation's
  data-parallel group is torchtitan's "loss" mesh (dp_replicate x dp_shard x cp: context-parallel ranks score whole
  rows of their own, as on the other frameworks); "tp" and "pp" are torchtitan's own meshes.
- `stages_of(schedule, parts)`: (stage index, number of stages, model part) of this rank, from torchtitan's pipeline
  schedule (one stage per rank, or several under looped / V schedules).
- `UnshardedParameters`: FSDP2 parameters gathered once for a whole evaluation and resharded after, so no forward
  of the evaluation all-gathers (FSDPModule.unshard / reshard / set_reshard_after_forward, with each FSDP parameter
  group's own reshard-after-forward setting put back exactly).
- `LocalContextParallel`: torchtitan's FlexAttention context parallelism (`apply_cp_to_forward` all-gathers keys
  and values over the CP mesh through `flex_cp_allgather`, looked up at every call) off while scoring.
- `spmd_inputs`: the SPMD context and input annotation torchtitan's Trainer applies under `spmd_types` (not testable
  on torch 2.13: that backend needs a newer torch).
- `learned_routing`: MoE routers route by their scores while scoring (the debug option that forces round-robin
  routing switched off, put back after).
- `cache_unsupported` / `inner_attention_replaced`: where the KV cache (nano_eval.backends.torchtitan_cache) plugs
  into torchtitan's attention: each layer's `attention.inner_attention` (the kernel called with rotated q, k, v),
  swapped for the cache's while decoding.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nano_eval.parallel import ParallelLayout

TESTED = ("0.3.0",)


def version() -> str:
    try:
        import torchtitan

        return str(getattr(torchtitan, "__version__", "unknown"))
    except ImportError:
        return "not installed"


def note_untested_version(is_main: bool) -> None:
    """One line on rank 0 when torchtitan is a release the tests did not cover."""
    found = version()
    if is_main and found not in TESTED:
        print(f"nano_eval: note: torchtitan {found} is not among the tested releases ({', '.join(TESTED)}); "
              "scores are checked against one process only there.", file=sys.stderr)


def _mesh(parallel_dims, name: str):
    """torchtitan's 1-D mesh `name`, or None when that parallelism is off."""
    return parallel_dims.get_optional_mesh(name)


def layout_of(parallel_dims, device: str) -> ParallelLayout:
    """ParallelLayout of this rank from torchtitan's ParallelDims (built meshes); None: every process a
    data-parallel replica (a checkpoint's model in one process per rank)."""
    if parallel_dims is None:
        return ParallelLayout.data_parallel()
    pd = parallel_dims
    dp = pd.dp_replicate * pd.dp_shard * pd.cp
    dp_mesh = _mesh(pd, "loss") if dp > 1 else None
    tp_mesh = _mesh(pd, "tp") if pd.tp > 1 else None
    pp_mesh = _mesh(pd, "pp") if pd.pp > 1 else None
    world = dist.get_world_size() if dist.is_initialized() else 1
    return ParallelLayout(
        rank=dist.get_rank() if dist.is_initialized() else 0, world_size=world,
        dp_rank=dp_mesh.get_local_rank() if dp_mesh else 0, dp_size=dp, dp_group=dp_mesh.get_group() if dp_mesh else None,
        tp_rank=tp_mesh.get_local_rank() if tp_mesh else 0, tp_size=pd.tp, tp_group=tp_mesh.get_group() if tp_mesh else None,
        pp_rank=pp_mesh.get_local_rank() if pp_mesh else 0, pp_size=pd.pp, pp_group=pp_mesh.get_group() if pp_mesh else None,
        input_pp_rank=0, output_pp_rank=pd.pp - 1, device=device,
        ep_size=getattr(pd, "ep", 1) or 1, cp_size=pd.cp,
    )


def fsdp_degree(parallel_dims) -> int:
    """Ranks a parameter is sharded over by FSDP2 (dp_shard x cp)."""
    if parallel_dims is None:
        return 1
    return parallel_dims.dp_shard * parallel_dims.cp


def spmd_backend(parallel_dims) -> str:
    if parallel_dims is None:
        return "partial_dtensor"
    return getattr(parallel_dims, "spmd_backend", None) or "partial_dtensor"


@dataclass(frozen=True)
class Stage:
    """One pipeline stage this rank holds: its index among `count` stages and its model part."""

    index: int
    count: int
    module: torch.nn.Module


def stages_of(schedule, parts: list) -> list[Stage]:
    """This rank's stages in torchtitan's pipeline schedule (torch.distributed.pipelining), in stage order; without
    a schedule (pp = 1), the one model part as stage 0 of 1."""
    if schedule is None:
        return [Stage(0, 1, parts[0])]
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    return sorted((Stage(s.stage_index, s.num_stages, s.submod) for s in stages), key=lambda s: s.index)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (this rank's part), a plain tensor as is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def like(tensor: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A plain tensor as a DTensor placed like `reference` (a plain reference: as is)."""
    from torch.distributed.tensor import DTensor

    if isinstance(reference, DTensor):
        return DTensor.from_local(tensor, reference.device_mesh, reference.placements, run_check=False)
    return tensor


def placement_code(tensor: torch.Tensor) -> int:
    """How `tensor` lies over the TP mesh, as one number a pipeline stage sends with it: -2 a plain tensor, -1
    replicated, d >= 0 sharded along dim d (torchtitan's activations between blocks: replicated, or sharded along
    the sequence under sequence parallelism)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return -2
    (placement,) = tensor.placements  # a 1-D TP mesh under torchtitan's partial_dtensor backend
    if isinstance(placement, Replicate):
        return -1
    if isinstance(placement, Shard):
        return placement.dim
    raise NotImplementedError(f"hidden states placed {placement} between pipeline stages")


def with_placement(tensor: torch.Tensor, code: int, parallel_dims) -> torch.Tensor:
    """The local `tensor` as a DTensor on this rank's TP mesh, placed as `placement_code` said (-2: as is)."""
    if code == -2:
        return tensor
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placement = Replicate() if code == -1 else Shard(code)
    return DTensor.from_local(tensor, _mesh(parallel_dims, "tp"), [placement], run_check=False)


def fsdp_modules(parts: list) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for part in parts for m in part.modules() if isinstance(m, FSDPModule)]


def unsharded_bytes(parts: list) -> int:
    """Bytes the FSDP2-sharded parameters of `parts` take once gathered over the FSDP mesh (this rank's TP share,
    in their forward dtype)."""
    total = 0
    for module in fsdp_modules(parts):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                dtype = getattr(getattr(p, "mp_policy", None), "param_dtype", None) or p.sharded_param.dtype
                total += int(torch.Size(p._orig_size).numel()) * dtype.itemsize
    return total


class UnshardedParameters:
    """While inside: every FSDP2 unit of the model parts holds its full parameters, gathered once on entry (one
    all-gather per unit, the same on every data-parallel rank), and keeps them through every forward; on exit each
    unit is resharded (local: frees the gathered copies) and gets its own reshard-after-forward setting back.
    Gradients, optimizer state and the sharded parameters are never touched."""

    def __init__(self, parts: list):
        self.modules = fsdp_modules(parts)

    @contextlib.contextmanager
    def applied(self):
        saved = []
        for module in self.modules:
            state = module._get_fsdp_state()
            saved.append((state, state._auto_reshard_after_forward,
                          [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups]))
        try:
            for module in self.modules:
                module.set_reshard_after_forward(False, recurse=False)
            for module in self.modules:
                module.unshard()
            yield
        finally:
            for module in self.modules:
                module.reshard()
            for state, auto, groups in saved:
                state._auto_reshard_after_forward = auto
                for group, info in groups:
                    group.post_forward_mesh_info = info


@contextlib.contextmanager
def local_context_parallel(parallel_dims):
    """While inside: torchtitan's FlexAttention context parallelism does not gather keys / values over the CP mesh
    (each CP rank scores whole rows as a data-parallel rank)."""
    if parallel_dims is None or parallel_dims.cp <= 1:
        yield
        return
    from torchtitan.distributed.context_parallel import api

    gather = api.flex_cp_allgather
    api.flex_cp_allgather = lambda k, v, dim, group_name: (k, v)
    try:
        yield
    finally:
        api.flex_cp_allgather = gather


def spmd_context(parallel_dims):
    """The context torchtitan's Trainer runs forwards in (its `train_context`): the runtime mesh under spmd_types."""
    if parallel_dims is None:
        return contextlib.nullcontext()
    from torchtitan.distributed import utils as dist_utils

    return dist_utils.get_spmd_context(parallel_dims=parallel_dims)()


def spmd_inputs(parallel_dims, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens / positions as torchtitan's Trainer hands them to the model (annotated under spmd_types)."""
    if spmd_backend(parallel_dims) != "spmd_types":
        return tokens, positions
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types

    tokens, _, extra = annotate_input_spmd_types(parallel_dims, tokens, tokens.clone(), {"positions": positions})
    return tokens, extra["positions"]


def token_dropping(parts: list) -> str | None:
    """What makes a MoE layer of `parts` drop tokens (scores would depend on the batch), or None. torchtitan's MoE
    routes every token to its top-k experts (dropless) in eval mode, except HybridEP's non-blocking dispatch with a
    capacity factor."""
    for part in parts:
        for name, module in part.named_modules():
            if getattr(module, "non_blocking_capacity_factor", None) is not None:
                return f"{name} ({type(module).__name__}) has non_blocking_capacity_factor set"
    return None


def has_moe(parts: list) -> bool:
    """Whether any model part holds a torchtitan MoE layer."""
    from torchtitan.models.common.moe import MoE

    return any(isinstance(m, MoE) for part in parts for m in part.modules())


@contextlib.contextmanager
def learned_routing(parts: list):
    """While inside: every MoE router routes by its scores. torchtitan's `--debug.moe_force_load_balance` makes
    routers assign experts round-robin by a token's index in its batch (`_debug_force_load_balance`), so a row's
    scores would depend on the rows before it; it is switched off and put back on exit."""
    forced = [m for part in parts for m in part.modules() if getattr(m, "_debug_force_load_balance", False) is True]
    try:
        for router in forced:
            router._debug_force_load_balance = False
        yield
    finally:
        for router in forced:
            router._debug_force_load_balance = True


def attention_masks(part, positions: torch.Tensor):
    """The masks torchtitan builds for its Flex / Varlen attention from per-token positions (None otherwise)."""
    from torchtitan.models.common.attention import FlexAttention, VarlenAttention

    config = getattr(part, "config", None)
    attention = getattr(config, "first_attention", None)
    inner = getattr(attention, "inner_attention", None)
    if isinstance(inner, (FlexAttention.Config, VarlenAttention.Config)):
        return part.get_attention_masks(positions=positions)
    return None


def _cacheable_attention_configs() -> tuple:
    """Attention configs whose module projects, rotates (RoPE at the given positions) and then calls
    `inner_attention(q, k, v, attention_masks=, scale=[, enable_gqa=])` with nothing else: torchtitan's GQA
    (Llama3, Qwen3 dense and MoE) and DeepSeek-V3's multi-latent attention."""
    from torchtitan.models.common.attention import GQAttention

    kinds = [GQAttention.Config]
    try:
        from torchtitan.models.deepseek_v3.model import Attention as LatentAttention

        kinds.append(LatentAttention.Config)
    except ImportError:
        pass
    return tuple(kinds)


def cache_unsupported(part) -> str | None:
    """Why torchtitan model `part` cannot decode from nano_eval's KV cache, or None. Reads the model's config only
    (the whole model's, also on a pipeline stage holding a few layers), so every rank gets the same answer."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
    from torchtitan.models.common.decoder import Decoder

    config = getattr(part, "config", None)
    layers = getattr(config, "layers", None)
    if not isinstance(part, Decoder) or layers is None:
        return f"{type(part).__name__} is not a torchtitan Decoder"
    if type(part).get_attention_masks is not Decoder.get_attention_masks:
        return f"{type(part).__name__} builds its own attention masks (sliding windows or other layer kinds)"
    if getattr(config, "mtp_layers", None):
        return "multi-token prediction layers"
    kinds = _cacheable_attention_configs()
    for index, layer in enumerate(layers):
        attention = getattr(layer, "attention", None)
        if not isinstance(attention, kinds):
            return f"layer {index}: attention {type(attention).__name__}"
        inner = attention.inner_attention
        if not isinstance(inner, (FlexAttention.Config, ScaledDotProductAttention.Config, VarlenAttention.Config)):
            return f"layer {index}: inner attention {type(inner).__name__}"
        if getattr(inner, "window_size", (-1, 0)) != (-1, 0):
            return f"layer {index}: attention window {inner.window_size}"
    return None


@contextlib.contextmanager
def inner_attention_replaced(parts: list, make):
    """While inside: in every model part, each layer's `attention.inner_attention` is `make(layer name)` (layer
    names are the model's own layer ids, unique across pipeline stages), and blocks that torchtitan compiled
    (`block.compile()`) run eagerly (the cache's shapes change at every step). Restored on exit."""
    swapped, compiled = [], []
    try:
        for part in parts:
            for name, layer in part.layers.items():
                attention = layer.attention
                swapped.append((attention, attention.inner_attention))
                attention.inner_attention = make(name)
                if getattr(layer, "_compiled_call_impl", None) is not None:
                    compiled.append((layer, layer._compiled_call_impl))
                    layer._compiled_call_impl = None
        yield
    finally:
        for attention, inner in swapped:
            attention.inner_attention = inner
        for layer, impl in compiled:
            layer._compiled_call_impl = impl
