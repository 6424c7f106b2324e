"""Read a Megatron torch_dist (distributed) checkpoint into one TP1 state dict, with megatron-core's own loader.

torch_dist is current Megatron-LM's default format: `iter_0001000/` holds `*.distcp` (tensor data), `.metadata`
(torch.distributed.checkpoint's index), `common.pt` (args, iteration, the non-sharded state) and `metadata.json`.
Its tensors are global, not per rank: layers are stacked along a leading axis, swiglu's linear_fc1 is saved as two
sharded halves, and the layer norms are named as Transformer Engine names them. Rather than re-implement that, we
build a real GPTModel (local layer spec, CPU, TP1/PP1) from the checkpoint's own args and let
`dist_checkpointing.load` reshard whatever TP x PP it was saved with into it. The result has the names and layout
of an `mp_rank_00` legacy checkpoint, so megatron_legacy.py converts it the same way.

Safety: `common.pt` is read with torch.load(weights_only=True) and megatron_args's allow-list. `.metadata` is a
plain pickle that torch.distributed.checkpoint would read with pickle.load; we read its bytes once, unpickle them
with an exact allow-list (torch.distributed.checkpoint's metadata classes, torch sizes / dtypes, paths) and hand
the resulting object to the loader, so no unchecked unpickling of that file ever happens.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from nano_eval.checkpoints.megatron_args import args_dict, hf_config_from_args, load_shard
from nano_eval.errors import NanoEvalError

COMMON = "common.pt"
CONTENT_METADATA = "content_metadata"  # where dist_checkpointing.save(content_metadata=...) puts it in common.pt
_DCP = "torch.distributed.checkpoint.metadata"
# Every global a torch_dist `.metadata` may name, as (the object's own __module__, its __qualname__). Each is a
# data class, an enum, a container or a plain look-up: calling it with any arguments builds data and nothing else.
METADATA_GLOBALS = frozenset({
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"), (_DCP, "StorageMeta"),
    (_DCP, "_MEM_FORMAT_ENCODING"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # layout name -> torch.layout, a dict look-up
    ("torch", "Size"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
})
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)  # torch.float32 & co: values, not callables


def is_dist_checkpoint(iter_dir: Path) -> bool:
    """Files of the whole model's tensors, sharded over ranks but named and numbered globally (not per rank)."""
    return (iter_dir / ".metadata").is_file() or any(iter_dir.glob("*.distcp"))


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals of METADATA_GLOBALS and torch's dtype / layout / memory-format constants.

    A name is looked up as one attribute of its module (no dotted paths such as `os.system` under an allowed
    module), the module is imported only once the pair is known to be allowed, and the object found must itself
    be defined under that very name (its __module__ / __qualname__), so an alias cannot smuggle anything in."""

    def find_class(self, module: str, name: str):
        allowed = (module, name) in METADATA_GLOBALS
        if not allowed and not (module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS)):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")
        found = getattr(importlib.import_module(module), name)
        if allowed and (found.__module__, found.__qualname__) != (module, name):
            raise pickle.UnpicklingError(f"{module}.{name} resolves to {found.__module__}.{found.__qualname__}")
        return found

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed in a checkpoint index")


def read_metadata_safely(iter_dir: Path):
    """The torch.distributed.checkpoint `Metadata` of `.metadata`, unpickled with the allow-list above.

    torch.distributed.checkpoint itself would unpickle the file unchecked; `_checked_index` hands it this object
    instead, so the bytes that were checked are the only bytes ever unpickled."""
    path = iter_dir / ".metadata"
    if not path.is_file():
        raise NanoEvalError(f"{iter_dir}: *.distcp files but no .metadata. Fix: finish copying the checkpoint.")
    data = path.read_bytes()
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - any failure to read it means: not loadable, and nothing ran
        raise NanoEvalError(f"{path}: refused to load ({type(e).__name__}: {e}); a torch_dist index holds only "
                            "torch.distributed.checkpoint metadata. Fix: re-save the checkpoint with Megatron, "
                            "or copy it again from a source you trust.") from e
    from torch.distributed.checkpoint.metadata import Metadata

    if type(metadata) is not Metadata:
        raise NanoEvalError(f"{path}: holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
                            "Metadata. Fix: point at a Megatron torch_dist iter_XXXXXXX folder.")
    return metadata


@contextlib.contextmanager
def _checked_index(metadata):
    """Inside: megatron-core's torch_dist loader reads the index from `metadata` instead of unpickling the file."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    if not callable(getattr(torch_strategy, "_get_filesystem_reader", None)):
        raise NanoEvalError("this megatron-core version reads torch_dist indexes in a way nano_eval cannot "
                            "intercept, and torch would unpickle `.metadata` unchecked. Fix: use megatron-core "
                            "0.16-0.19, or convert the checkpoint to the legacy format.")

    class CheckedIndexReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    original = torch_strategy._get_filesystem_reader
    torch_strategy._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: CheckedIndexReader(
        checkpoint_dir)
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = original


def read_common(iter_dir: Path) -> dict:
    """`common.pt` (args, iteration, content metadata), loaded safely."""
    if not (iter_dir / COMMON).is_file():
        raise NanoEvalError(f"{iter_dir}: no {COMMON} (it holds the model arguments). Fix: finish copying the "
                            "checkpoint, or point at the iter_XXXXXXX folder itself.")
    return load_shard(iter_dir / COMMON)


def transformer_config(args: Mapping):
    """megatron-core's TransformerConfig for a Llama-style GPT (Megatron-LM argument names), on CPU at the
    current parallel_state's TP / PP sizes; weights are not initialised (the checkpoint overwrites them)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    heads = args["num_attention_heads"]
    dtype = args.get("params_dtype") if isinstance(args.get("params_dtype"), torch.dtype) else torch.float32
    return TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
        num_attention_heads=heads,
        num_query_groups=args.get("num_query_groups") if args.get("group_query_attention") else heads,
        kv_channels=args.get("kv_channels") or args["hidden_size"] // heads, normalization="RMSNorm",
        layernorm_epsilon=args.get("norm_epsilon", 1e-5), gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=False, add_bias_linear=False, add_qkv_bias=False,
        rotary_interleaved=bool(args.get("rotary_interleaved")),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(), pipeline_dtype=dtype,
        params_dtype=dtype,
        use_cpu_initialization=True, perform_initialization=False)


def build_gpt_model(args: Mapping):
    """This rank's GPTModel stage (local layer spec: no Transformer Engine needed); at TP1/PP1, the whole model."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    try:
        return GPTModel(
            config=transformer_config(args), transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=args["padded_vocab_size"],
            max_sequence_length=args.get("max_position_embeddings") or args["seq_length"],
            pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not args.get("untie_embeddings_and_output_weights", False),
            position_embedding_type="rope", rotary_percent=1.0, rotary_base=int(args.get("rotary_base", 10000)))
    except KeyError as e:
        raise NanoEvalError(f"the checkpoint's args lack {e}. Fix: pass megatron_args=... (Megatron's names).") from e


@contextlib.contextmanager
def single_stage_parallel_state():
    """torch.distributed and Megatron's parallel_state at TP1 / PP1 for the load; undoes only what it set up.

    Without a process group: a 1-process gloo group on an in-memory store (no port). Inside a world of N ranks
    (torchrun): every rank must call this; each builds the whole model and loads it (DP = N)."""
    from nano_eval.compat.megatron import import_megatron_core, initialize_cpu_model_parallel

    ps = import_megatron_core()
    own_world = not dist.is_initialized()
    if own_world:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    own_state = not ps.model_parallel_is_initialized()
    try:
        if own_state:
            initialize_cpu_model_parallel(tp=1, pp=1)
        elif (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()) != (1, 1):
            raise NanoEvalError("Megatron's parallel_state is already initialised with TP/PP > 1, so a torch_dist "
                                "checkpoint cannot be loaded as one TP1 model here. Fix: score it from run.py, or "
                                "score the live model with the MegatronModel backend.")
        yield
    finally:
        if own_state:
            ps.destroy_model_parallel()
        if own_world:
            dist.destroy_process_group()


def _model_only(sharded: dict) -> dict:
    """The tensors to load: `_extra_state` objects (Transformer Engine's FP8 bookkeeping) are not weights."""
    from megatron.core.dist_checkpointing import ShardedObject

    return {k: v for k, v in sharded.items() if not k.endswith("_extra_state") and not isinstance(v, ShardedObject)}


def _reason(error: BaseException) -> str:
    """One line: torch's CheckpointException wraps each rank's (error, traceback) (e.g. a global shape mismatch)."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))
        error = error[0] if isinstance(error, tuple) else error
    return f"{type(error).__name__}: {(str(error) or repr(error)).strip().splitlines()[-1][:300]}"


def read_dist_checkpoint(iter_dir: str | Path, overrides: Mapping | None = None) -> tuple[dict, dict]:
    """({Megatron name: full tensor} as one TP1/PP1 GPTModel's state dict, args) of a torch_dist checkpoint.

    overrides: Megatron argument names/values that replace the pickled args (e.g. for an old checkpoint)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from torch.distributed.checkpoint.api import CheckpointException

    iter_dir = Path(iter_dir)
    common = read_common(iter_dir)
    metadata = read_metadata_safely(iter_dir)
    args = {**args_dict(common.get("args")), **dict(overrides or {})}
    hf_config_from_args(args, vocab_size=args.get("padded_vocab_size") or 1)  # refuses non-Llama args early

    class _AlreadyRead(TorchCommonLoadStrategy):  # common.pt was read above, safely: do not torch.load it again
        def load_common(self, checkpoint_dir):
            return {}

    with single_stage_parallel_state(), _checked_index(metadata):
        model = build_gpt_model(args)
        sharded = _model_only(model.sharded_state_dict(metadata=common.get(CONTENT_METADATA)))
        try:
            loaded = dist_checkpointing.load(sharded, str(iter_dir), common_strategy=_AlreadyRead())
        except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
            raise NanoEvalError(f"{iter_dir}: megatron-core could not load it into a GPTModel built from its args "
                                f"({_reason(e)}). Fix: check that it is a Llama-style GPT checkpoint; pass "
                                "megatron_args=... if its args are wrong.") from e
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}, args
