"""ParallelLayout: the one view of the process groups that the scoring core sees.

Backends build it from their framework (plain torch.distributed, a nanotron `ParallelContext`, Megatron's
`parallel_state`); nothing else in nano_eval asks torch.distributed for ranks. Every collective here names its
group explicitly and is skipped when the group has one member.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Ranks and groups of one process. `output_pp_rank` is the pipeline stage that holds the logits.

    ep_size, cp_size and moe_routing only describe the model (results.json's layout): expert parallelism lives
    inside dp (MoE layers), context-parallel ranks are counted in dp (each scores whole rows while evaluating), and
    moe_routing says how MoE layers route while scoring ("dropless")."""

    rank: int = 0
    world_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    dp_group: Any = None
    tp_group: Any = None
    pp_group: Any = None
    input_pp_rank: int = 0
    output_pp_rank: int = 0
    device: str = "cpu"  # where collective buffers live: "cuda" under nccl, "cpu" under gloo
    ep_size: int = 1
    cp_size: int = 1
    moe_routing: str | None = None

    def __post_init__(self):
        if self.dp_size * self.tp_size * self.pp_size != self.world_size:
            raise ValueError(
                f"Parallel layout does not cover the world: dp={self.dp_size} x tp={self.tp_size} x "
                f"pp={self.pp_size} = {self.dp_size * self.tp_size * self.pp_size}, but world_size={self.world_size}."
            )
        for name in ("dp", "tp", "pp"):
            r, s = getattr(self, f"{name}_rank"), getattr(self, f"{name}_size")
            if not 0 <= r < s:
                raise ValueError(f"{name}_rank={r} is outside [0, {name}_size={s}).")
        if not 0 <= self.output_pp_rank < self.pp_size:
            raise ValueError(f"output_pp_rank={self.output_pp_rank} is outside [0, pp_size={self.pp_size}).")

    @property
    def is_output_stage(self) -> bool:
        """True on the pipeline stage whose forward returns the logits."""
        return self.pp_rank == self.output_pp_rank

    @property
    def is_main(self) -> bool:
        """Global rank 0: the rank that prints and writes files."""
        return self.rank == 0

    def describe(self) -> dict[str, int | str]:
        """{world_size, dp, tp, pp}, plus ep / cp_in_dp / moe_routing where the model has them."""
        out: dict[str, int | str] = {"world_size": self.world_size, "dp": self.dp_size, "tp": self.tp_size,
                                     "pp": self.pp_size}
        if self.ep_size > 1:
            out["ep"] = self.ep_size
        if self.cp_size > 1:
            out["cp_in_dp"] = self.cp_size
        if self.moe_routing:
            out["moe_routing"] = self.moe_routing
        return out

    @classmethod
    def data_parallel(cls) -> ParallelLayout:
        """Every process is a data-parallel replica (the transformers backend); one process without torch.distributed."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        world, rank = dist.get_world_size(), dist.get_rank()
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        return cls(rank=rank, world_size=world, dp_rank=rank, dp_size=world, dp_group=dist.group.WORLD, device=device)


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: Any, size: int) -> torch.Tensor:
    """In-place all-reduce over `group`; a no-op for a group of one."""
    if size > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def sum_over_dp(counts: dict[str, int], layout: ParallelLayout) -> dict[str, int]:
    """{name: count} summed over the data-parallel ranks (one all-reduce; the same dict on every rank)."""
    names = sorted(counts)
    if layout.dp_size == 1 or not names:
        return {name: counts[name] for name in names}
    total = torch.tensor([counts[name] for name in names], dtype=torch.int64, device=layout.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=layout.dp_group)
    return dict(zip(names, total.tolist()))


def broadcast_from_output_stage(obj: Any, layout: ParallelLayout) -> Any:
    """Send a picklable object from the output pipeline stage to every stage of this pipeline."""
    if layout.pp_size == 1:
        return obj
    box = [obj if layout.is_output_stage else None]
    dist.broadcast_object_list(box, group=layout.pp_group, group_src=layout.output_pp_rank)
    return box[0]


def broadcast_tensor_from_output_stage(tensor: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """Tensor version of `broadcast_from_output_stage`; every stage passes a tensor of the same shape and dtype."""
    if layout.pp_size > 1:
        dist.broadcast(tensor, group=layout.pp_group, group_src=layout.output_pp_rank)
    return tensor


def gather_dicts_over_dp(local: dict, layout: ParallelLayout) -> dict:
    """Merge the result dicts of all data-parallel ranks (duplicate keys from sampler padding collapse)."""
    if layout.dp_size == 1:
        return dict(local)
    parts: list[dict | None] = [None] * layout.dp_size
    dist.all_gather_object(parts, local, group=layout.dp_group)
    merged: dict = {}
    for part in parts:
        merged.update(part)
    return merged


def any_rank_true(flag: bool, group: Any, size: int, device: str = "cpu") -> bool:
    """True on every rank of `group` when at least one rank passes True (used to agree on errors and early stops)."""
    if size == 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())
