"""Everything nano_eval needs to know about megatron-core's versions, in one module.

`RELEASES` below is the table of what changed between megatron-core 0.16 and 0.19 that nano_eval relies on (one
row per minor release, read down a column); the functions after it are the only places that read it. The CI runs
the megatron tests on 0.16.1 (the main environment) and 0.19.2 (`scripts/setup_megatron_019.sh`); 0.17 and 0.18
are described from their source. A release outside 0.16.1-0.19.2 gets a one-line warning when the backend is
built (`release_warning`), and a minor release not in the table keeps only what nano_eval can check for itself:
greedy generation then re-runs the prompt for every token instead of trusting a KV cache it has not verified.

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
- Megatron-LM's own package (`megatron.training`) ships in the megatron-core wheel from 0.17 on; it imports on
  Python >= 3.12 only (`typing.override`), and its `get_args()` raises AssertionError ("args is not initialized")
  in a plain megatron-core loop: `megatron_lm_args` treats both as "not under Megatron-LM's pretrain".
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from dataclasses import dataclass

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
    """(major, minor, patch) of the installed megatron-core."""
    from megatron.core import package_info

    return package_info.MAJOR, package_info.MINOR, package_info.PATCH


def version_string() -> str:
    """The installed megatron-core's version as "0.19.2" ("(version unknown)" if it cannot be read). Not
    package_info.__version__: 0.19 appends the git commit of whatever repository holds site-packages."""
    try:
        return ".".join(map(str, megatron_core_version()))
    except (ImportError, AttributeError):
        return "(version unknown)"


# ---- what differs between megatron-core releases ----------------------------------------------------------------

@dataclass(frozen=True)
class Release:
    """What nano_eval relies on in one megatron-core minor release (the columns of RELEASES)."""

    # Greedy decoding from StaticInferenceContext (nano_eval.backends.megatron_cache). The context asks GPTModel to
    # hand the output layer only the last column ([1, b, H]): where that switch (materialize_only_last_token_logits)
    # lives, "context" or "context.config" (an InferenceConfig from 0.17). From 0.18 GPTModel obeys it only while
    # megatron.core.inference.utils.InferenceMode is active (`inference_mode_flag`), which nano_eval never sets (it
    # would switch MoE layers and routers to their inference paths): the output layer then gets every new column,
    # and a decoder that read "the last column" at index 0 got the prompt's FIRST position on 0.18/0.19 (the wrong
    # generation of issue 42). nano_eval now switches it off on every release and picks the column itself.
    last_token_switch: str
    inference_mode_flag: bool
    # torch_dist checkpoints (nano_eval.checkpoints.megatron_dist). `common_state`: where Megatron-LM's save puts the
    # args, iteration and content metadata: "common.pt", or (0.19) "common_state", a ShardedObject inside the
    # .distcp files (a torch.save'd [dict]). `common_loader`: how dist_checkpointing.load reads it, which nano_eval
    # answers with nothing, having read it with its own unpickler (megatron-core would torch.load it unchecked):
    # "common_strategy" (the load argument, 0.16), or the name of the function in
    # megatron.core.dist_checkpointing.serialization that load calls (0.17: the argument must be None).
    common_state: str
    common_loader: str
    # Mixture of Experts: the experts classes (GroupedMLP, the legacy grouped GEMM, is gone from 0.17; the local spec
    # builds SequentialMLP; TEGroupedMLP needs Transformer Engine), and what nano_eval switches to route dropless
    # (nano_eval.backends.megatron_scoring): config fields -> their dropless values, and the fields each token
    # dispatcher (or flex dispatcher's communication manager) copies from the config at construction.
    experts: tuple[str, ...]
    dropless_config: tuple[tuple[str, object], ...]
    dispatcher_fields: tuple[tuple[str, tuple[str, ...]], ...]


_DROPLESS_016 = (("moe_expert_capacity_factor", None), ("moe_pad_expert_input_to_capacity", False),
                 ("moe_input_jitter_eps", None))
_DISPATCHERS_016 = (("MoEAllGatherTokenDispatcher", ()), ("MoEAlltoAllTokenDispatcher", ("drop_and_pad",)),
                    ("MoEFlexTokenDispatcher", ("_comm_manager",)), ("_DeepepManager", ("capacity_factor",)),
                    ("_HybridEPManager", ("capacity_factor", "drop_and_pad")))
# 0.18: the hybrid-EP manager also drops tokens past a per-rank budget (moe_expert_rank_capacity_factor); 0.19's
# NCCL-EP manager (_NCCLEPManager, Transformer Engine) is not listed, so a model using it is refused
_DROPLESS_018 = _DROPLESS_016 + (("moe_expert_rank_capacity_factor", None),)
_DISPATCHERS_018 = _DISPATCHERS_016[:-1] + (
    ("_HybridEPManager", ("capacity_factor", "drop_and_pad", "moe_expert_rank_capacity_factor")),)
_EXPERTS_016 = ("GroupedMLP", "TEGroupedMLP", "SequentialMLP")
_EXPERTS_017 = ("TEGroupedMLP", "InferenceGroupedMLP", "SequentialMLP")

RELEASES: dict[tuple[int, int], Release] = {
    (0, 16): Release("context", False, "common.pt", "common_strategy", _EXPERTS_016, _DROPLESS_016,
                     _DISPATCHERS_016),
    (0, 17): Release("context.config", False, "common.pt", "load_common", _EXPERTS_017, _DROPLESS_016,
                     _DISPATCHERS_016),
    (0, 18): Release("context.config", True, "common.pt", "load_common", _EXPERTS_017, _DROPLESS_018,
                     _DISPATCHERS_018),
    (0, 19): Release("context.config", True, "common_state", "load_common_state_dict", _EXPERTS_017, _DROPLESS_018,
                     _DISPATCHERS_018),
}
TESTED = ((0, 16, 1), (0, 19, 2))  # the oldest and newest release the CI runs every megatron test on


def release(version: tuple[int, int, int] | None = None) -> Release | None:
    """The RELEASES row of `version` (default: the installed megatron-core), None for a minor release not in it."""
    major, minor, _ = version or megatron_core_version()
    return RELEASES.get((major, minor))


def release_warning(version: tuple[int, int, int] | None = None) -> str | None:
    """One line for a megatron-core outside the tested range (TESTED), None inside it."""
    version = version or megatron_core_version()
    if TESTED[0] <= tuple(version) <= TESTED[-1]:
        return None
    low, high = (".".join(map(str, v)) for v in (TESTED[0], TESTED[-1]))
    what = ("greedy generation re-runs the prompt per token (no KV cache nano_eval has not verified)"
            if release(version) is None else f"nano_eval treats it as {version[0]}.{version[1]} "
            "(nano_eval.compat.megatron.RELEASES)")
    return (f"nano_eval: warning: megatron-core {'.'.join(map(str, version))} is outside the releases nano_eval is "
            f"tested on ({low} to {high}); {what}. Check scores against a tested release before trusting them.")


_WARNED: set = set()


def warn_untested_release(is_main: bool = True) -> None:
    """Print `release_warning` once per process, on the main rank (when the backend is built)."""
    line = release_warning()
    if line is not None and is_main and line not in _WARNED:
        _WARNED.add(line)
        print(line, file=sys.stderr, flush=True)


def static_inference_context(rows: int, columns: int):
    """megatron-core's StaticInferenceContext for `rows` x `columns` of KV cache that hands the output layer EVERY
    new column ([n, b, H]) on every release (see Release.last_token_switch); None where this release keeps that
    switch somewhere nano_eval does not know (the caller then re-runs prompts instead)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    row = release()
    if row is None:
        return None
    context = StaticInferenceContext(max_batch_size=rows, max_sequence_length=columns)
    owner = context.config if row.last_token_switch == "context.config" else context
    if not isinstance(getattr(owner, "materialize_only_last_token_logits", None), bool):
        return None
    owner.materialize_only_last_token_logits = False
    return context


def inference_mode_active() -> bool:
    """Whether megatron-core's process-wide InferenceMode is on (0.18+; someone else's inference engine): GPTModel
    then takes its inference branches, which nano_eval's decoder does not expect."""
    row = release()
    if row is None or not row.inference_mode_flag:
        return False
    from megatron.core.inference.utils import InferenceMode

    return InferenceMode.is_active()


@contextlib.contextmanager
def common_state_not_reread() -> Iterator[dict]:
    """Inside: megatron-core's dist_checkpointing.load does not read (unpickle) the checkpoint's common state, which
    nano_eval already read with its own unpickler: the hook this release's load reads it through
    (Release.common_loader) returns an empty dict (the caller keeps only the loaded tensors). Yields the keyword
    arguments to pass to `load`; raises NanoEvalError where this release reads it some way nano_eval does not know,
    and after the load if load never asked (it would have read it another way)."""
    from megatron.core.dist_checkpointing import serialization

    row = release()
    asked = []
    if row is not None and row.common_loader == "common_strategy":
        from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

        class NotReread(TorchCommonLoadStrategy):
            def load_common(self, checkpoint_dir):
                asked.append(checkpoint_dir)
                return {}

        yield {"common_strategy": NotReread()}
        _check_asked(asked)
        return
    name = row.common_loader if row is not None else None
    if name is None or not callable(getattr(serialization, name, None)):
        raise NanoEvalError(f"megatron-core {version_string()} reads a torch_dist checkpoint's common state in a way "
                            "nano_eval cannot intercept (torch would unpickle it unchecked). Fix: load it with "
                            f"megatron-core {'.'.join(map(str, TESTED[0]))} to {'.'.join(map(str, TESTED[-1]))}.")
    original = getattr(serialization, name)

    def not_reread(checkpoint_dir, *args, **kwargs):
        asked.append(checkpoint_dir)
        return {}

    setattr(serialization, name, not_reread)
    try:
        yield {}
    finally:
        setattr(serialization, name, original)
    _check_asked(asked)


def _check_asked(asked: list) -> None:
    if not asked:
        raise NanoEvalError(f"megatron-core {version_string()}'s dist_checkpointing.load did not read the common "
                            "state through the function nano_eval answers for it. Fix: report this message to "
                            "nano_eval.")


def megatron_lm_args():
    """Megatron-LM's global args (`megatron.training.get_args()`), or None outside Megatron-LM's pretrain: where
    megatron.training is not importable (not installed; or the 0.17+ wheel's copy on Python < 3.12), or where it
    is but nobody initialised its args (a plain megatron-core loop: get_args() asserts)."""
    try:
        from megatron.training import get_args
    except ImportError:
        return None
    try:
        return get_args()
    except AssertionError:  # "args is not initialized."
        return None


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
