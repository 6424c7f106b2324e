"""Everything nano_eval needs to know about megatron-core's versions, in one module.

- The layout comes from `megatron.core.parallel_state` (every release up to 0.16 and later), or from a
  `ProcessGroupCollection` (`pg_collection`, with `.tp`, `.pp`, `.dp` (`.dp_cp`, `.cp`) groups) that newer
  releases pass around instead of the global state. Context-parallel ranks score whole rows as data-parallel
  ranks (the data-parallel-with-CP group; nano_eval.backends.megatron_scoring switches CP off in the model while
  scoring). Expert parallelism lives inside the data-parallel ranks and is reported, not sharded on.
- `get_forward_backward_func` and the schedule it returns gained keyword arguments over releases
  (`pg_collection`, `p2p_communicator`, `adjust_tensor_shapes_fn`; 0.20 adds `schedule_pg_collection` to the
  getter): `call_schedule` passes only the keywords the installed schedule accepts.
- On a CPU-only torch, `initialize_model_parallel` and the tensor-parallel layers work as they are; GPTModel, the
  schedules, DDP and the optimizer have a few CUDA-only calls (the tests answer them with tests/megatron_cpu.py).
  `initialize_cpu_model_parallel` is for the torch_dist checkpoint loader and CPU tests.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch.distributed as dist

from nano_eval.errors import NanoEvalError
from nano_eval.parallel import ParallelLayout


def import_megatron_core():
    """Import megatron.core, or say how to install it."""
    try:
        from megatron.core import parallel_state
    except ImportError as e:
        raise NanoEvalError(
            "megatron-core is not installed. Fix: pip install -e '.[megatron]' in the nano_eval checkout "
            "(megatron-core>=0.16)."
        ) from e
    return parallel_state


def megatron_core_version() -> tuple[int, int, int]:
    from megatron.core import package_info

    return package_info.MAJOR, package_info.MINOR, package_info.PATCH


def _rank_and_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def layout_from_megatron(pg_collection=None, device: str | None = None) -> ParallelLayout:
    """ParallelLayout view of Megatron's process groups (parallel_state, or a ProcessGroupCollection).

    Logits come out of the last pipeline stage (output_pp_rank = pp - 1); inputs enter on the first. Under context
    parallelism the data-parallel group is the one with the CP ranks (dp x cp replicas, each scoring whole rows).
    device: where collective buffers live; default "cuda" under nccl, "cpu" otherwise.
    """
    ps = import_megatron_core()
    if pg_collection is not None:
        tp_group, pp_group = pg_collection.tp, pg_collection.pp
        cp_group = getattr(pg_collection, "cp", None)
        cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        dp_group = pg_collection.dp_cp if cp_size > 1 else pg_collection.dp
        ep_group = getattr(pg_collection, "ep", None)
        ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    else:
        if not ps.model_parallel_is_initialized():
            raise NanoEvalError(
                "megatron parallel_state is not initialised. Fix: call "
                "megatron.core.parallel_state.initialize_model_parallel(...) (pretrain does) before building "
                "the MegatronModel backend, or pass pg_collection."
            )
        tp_group, pp_group = ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group()
        dp_group = ps.get_data_parallel_group(with_context_parallel=True)
        cp_size, ep_size = ps.get_context_parallel_world_size(), ps.get_expert_model_parallel_world_size()
    (tp_rank, tp), (pp_rank, pp), (dp_rank, dp) = map(_rank_and_size, (tp_group, pp_group, dp_group))
    world = dist.get_world_size()
    if tp * pp * dp != world:  # a partial layout (e.g. a pg_collection without its dp_cp group)
        raise NanoEvalError(
            f"megatron layout tp={tp} x pp={pp} x dp={dp} (with cp={cp_size}) = {tp * pp * dp} does not cover "
            f"world_size={world}. Fix: pass a pg_collection whose tp, pp and dp (dp_cp under context "
            "parallelism) groups cover the world, or build the backend after initialize_model_parallel."
        )
    if device is None:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return ParallelLayout(
        rank=dist.get_rank(), world_size=world,
        dp_rank=dp_rank, dp_size=dp, dp_group=dp_group,
        tp_rank=tp_rank, tp_size=tp, tp_group=tp_group,
        pp_rank=pp_rank, pp_size=pp, pp_group=pp_group,
        input_pp_rank=0, output_pp_rank=pp - 1,
        device=device, ep_size=ep_size, cp_size=cp_size,
    )


def initialize_cpu_model_parallel(tp: int = 1, pp: int = 1) -> None:
    """parallel_state on gloo (torch.distributed must be initialised); dp = world / (tp x pp). For CPU tests
    and the torch_dist checkpoint loader: gloo sub-groups are skipped (the default backend already is gloo, or
    the loader only needs TP1/PP1)."""
    ps = import_megatron_core()
    kwargs = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp}
    if "create_gloo_process_groups" in inspect.signature(ps.initialize_model_parallel).parameters:
        kwargs["create_gloo_process_groups"] = False
    with owned_process_groups():
        ps.initialize_model_parallel(**kwargs)


_OWN_GROUPS: list = []  # process groups made while nano_eval set parallel_state up (owned_process_groups)


def _process_groups() -> list:
    """Every process group of this process (torch's registry; empty where a torch release lacks it)."""
    return list(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {}))


@contextlib.contextmanager
def owned_process_groups() -> Iterator[None]:
    """The process groups made inside (megatron's `initialize_model_parallel`) become nano_eval's own: the next
    `reset_model_parallel` destroys them."""
    before = set(_process_groups())
    yield
    _OWN_GROUPS.extend(g for g in _process_groups() if g not in before)


def reset_model_parallel() -> None:
    """Tear parallel_state down and destroy the process groups nano_eval made for it, before it is set up again in
    another layout. megatron-core's `destroy_model_parallel` only forgets its groups: a sweep that loads checkpoint
    after checkpoint would keep every earlier checkpoint's groups alive, each with its gloo threads or NCCL
    communicator buffers (measured on CPU/gloo, 4 ranks: scoring 2.4x slower after 12 re-initialisations). Groups
    made by anyone else (a trainer's) are never touched."""
    ps = import_megatron_core()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    alive = set(_process_groups())
    for group in _OWN_GROUPS:
        if group in alive:
            dist.destroy_process_group(group)
    _OWN_GROUPS.clear()


def initialize_model_parallel_for_eval(*, tp: int, pp: int, ep: int = 1, device: str = "cpu") -> None:
    """parallel_state at tp x pp x ep for a model nano_eval builds itself (`--backend megatron`); torch.distributed
    must be initialised. On CPU (gloo), megatron's extra gloo groups are skipped (the default group is gloo)."""
    ps = import_megatron_core()
    kwargs = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
              "expert_model_parallel_size": ep}
    if not device.startswith("cuda") and "create_gloo_process_groups" in inspect.signature(
            ps.initialize_model_parallel).parameters:
        kwargs["create_gloo_process_groups"] = False
    with owned_process_groups():
        ps.initialize_model_parallel(**kwargs)


def unwrap(module):
    """The model inside Megatron's wrappers (DistributedDataParallel, Float16Module, FSDP: all keep `.module`)."""
    while hasattr(module, "module") and module.module is not module:
        module = module.module
    return module


def call_schedule(forward_step_func, data_iterator, chunks: list, *, num_microbatches: int, seq_length: int,
                  micro_batch_size: int) -> list:
    """Megatron's pipeline schedule in forward-only mode, collecting what the forward step's "loss function"
    returns on the last stage (non-loss data); [] on the other stages."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    schedule = get_forward_backward_func()
    kwargs = dict(forward_step_func=forward_step_func, data_iterator=data_iterator,
                  model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=num_microbatches,
                  seq_length=seq_length, micro_batch_size=micro_batch_size, decoder_seq_length=seq_length,
                  forward_only=True, collect_non_loss_data=True)
    accepted = inspect.signature(schedule).parameters
    return schedule(**{k: v for k, v in kwargs.items() if k in accepted})
