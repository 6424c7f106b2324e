"""Read a Megatron torch_dist (distributed) checkpoint into one TP1 state dict, with megatron-core's own loader
and nano_eval's own file reader.

torch_dist is current Megatron-LM's default format: `iter_0001000/` holds `*.distcp` (tensor data), `.metadata`
(torch.distributed.checkpoint's index), `metadata.json`, and the common state (args, iteration, the non-sharded
state): `common.pt` up to megatron-core 0.18, from 0.19 a `common_state` entry inside the `.distcp` files (a
torch.save'd [dict]; nano_eval.compat.megatron.Release.common_state). Both are read.
Its tensors are global, not per rank: layers are stacked along a leading axis, swiglu's linear_fc1 is saved as two
sharded halves, and the layer norms are named as Transformer Engine names them. Rather than re-implement that, we
build a real GPTModel (local layer spec, CPU, TP1/PP1) from the checkpoint's own args and let
`dist_checkpointing.load` reshard whatever TP x PP it was saved with into it. The result has the names and layout
of an `mp_rank_00` legacy checkpoint, so megatron_legacy.py converts it the same way.

Safety (the checkpoint is untrusted; see untrusted.py and pickles.py):
- `.metadata` and the common state (`common.pt`, or 0.19's `common_state` bytes, which
  torch.distributed.checkpoint would unpickle itself) are read by nano_eval's own unpickler; the index is then
  checked whole
  (`check_index`): every storage entry names a bare `.distcp` file of the folder with its byte range inside it,
  every tensor entry has plain sizes whose chunks fit their bytes.
- The model's size is computed from the args and refused when larger than the files or the allocation limit,
  before megatron-core builds anything.
- torch.distributed.checkpoint's own reader would `torch.load(..., weights_only=False)` any entry the index calls
  bytes, even where the model asks for a tensor. megatron-core is handed `CheckedReader` instead: it serves the
  validated index and reads only tensor chunks, each with nano_eval's torch.save reader; a bytes entry is refused.
  megatron-core's load does not read (unpickle) the common state again
  (nano_eval.compat.megatron.common_state_not_reread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from nano_eval.checkpoints.cover import cover_problem
from nano_eval.checkpoints.megatron_args import LLAMA_STYLE, args_dict, check_model_size, hf_config_from_args, load_shard
from nano_eval.checkpoints.megatron_model import build_gpt_model
from nano_eval.checkpoints.pickles import TENSORS, dcp_index, unpickle
from nano_eval.checkpoints.torch_files import load_torch
from nano_eval.checkpoints.untrusted import CONFIG_BYTES, CheckpointFileError, FilePolicy, Folder
from nano_eval.errors import NanoEvalError

COMMON = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # megatron-core 0.19: ShardedObject("common_state", ..., (1,), (0,))
INDEX = ".metadata"
CONTENT_METADATA = "content_metadata"  # where dist_checkpointing.save(content_metadata=...) puts it in common.pt
INDEX_BYTES = 1 << 30


def is_dist_checkpoint(iter_dir: Path) -> bool:
    """Files of the whole model's tensors, sharded over ranks but named and numbered globally (not per rank)."""
    return (iter_dir / INDEX).is_file() or any(iter_dir.glob("*.distcp"))


def read_metadata_safely(iter_dir: Path, policy: FilePolicy = FilePolicy()):
    """The torch.distributed.checkpoint `Metadata` of `.metadata`, unpickled by nano_eval's own unpickler (only
    the index's dataclasses and plain values), then checked whole (`check_index`)."""
    from torch.distributed.checkpoint.metadata import Metadata

    folder = Folder(iter_dir, policy)
    if not folder.has(INDEX):
        raise CheckpointFileError(iter_dir, "has *.distcp files but no .metadata", "finish copying the checkpoint")
    path = folder.root / INDEX
    metadata = unpickle(folder.read_bytes(INDEX, INDEX_BYTES), dcp_index(), path)
    if type(metadata) is not Metadata:
        raise CheckpointFileError(path, f"holds a {type(metadata).__name__}, not torch.distributed.checkpoint "
                                  "Metadata", "point at a Megatron torch_dist iter_XXXXXXX folder")
    check_index(metadata, folder, path)
    return metadata


def check_index(metadata, folder: Folder, where: Path) -> int:
    """Refuse an index that points outside its folder or past its files, or declares chunks larger than their
    bytes; returns the bytes of the `.distcp` files it uses."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    def bad(what: str) -> CheckpointFileError:
        return CheckpointFileError(where, what)

    if not isinstance(metadata.storage_data, dict) or not isinstance(metadata.state_dict_metadata, dict):
        raise bad("has no storage table or no tensor table")
    sizes: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo or not isinstance(index.fqn, str):
            raise bad(f"has a storage entry of {type(index).__name__} -> {type(info).__name__}")
        name = info.relative_path
        if not (isinstance(name, str) and name.endswith(".distcp") and "/" not in name and "\\" not in name
                and "\0" not in name and not name.startswith(".")):
            raise bad(f"entry {index.fqn} points at {name!r:.100}, not a .distcp file of this folder")
        if info.transform_descriptors:
            raise bad(f"entry {index.fqn} is stored through transforms {info.transform_descriptors!r:.80} "
                      "(compression / encryption) that nano_eval does not read")
        if name not in sizes:
            sizes[name] = folder.file(name).stat().st_size
        if not (type(info.offset) is int and type(info.length) is int and 0 <= info.offset
                and 0 <= info.length and info.offset + info.length <= sizes[name]):
            raise bad(f"entry {index.fqn} declares bytes {info.offset!r:.30}+{info.length!r:.30} of {name}, "
                      f"which holds {sizes[name]}")
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"has a tensor name of type {type(fqn).__name__}")
        if type(md) is BytesStorageMetadata:
            continue  # only read if the model asks for it, and then refused (CheckedReader)
        if type(md) is not TensorStorageMetadata or type(md.properties) is not TensorProperties or not isinstance(
                md.properties.dtype, torch.dtype) or not _is_size(md.size) or not isinstance(md.chunks, list):
            raise bad(f"entry {fqn} is not a plain tensor description")
        itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
        for chunk in md.chunks:
            if type(chunk) is not ChunkStorageMetadata or not _is_size(chunk.offsets) or not _is_size(chunk.sizes) \
                    or len(chunk.offsets) != len(md.size) or len(chunk.sizes) != len(md.size) \
                    or any(o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, md.size)):
                raise bad(f"entry {fqn} has a chunk outside its tensor of size {list(md.size)}")
            info = metadata.storage_data.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise bad(f"entry {fqn} has a chunk at {list(chunk.offsets)} with no storage entry")
            if _numel(chunk.sizes) * itemsize > info.length:
                raise bad(f"entry {fqn} declares a chunk of {_numel(chunk.sizes)} x {itemsize} bytes stored in "
                          f"{info.length} bytes")
    return sum(sizes.values())


def _is_size(value) -> bool:
    return isinstance(value, torch.Size) and all(type(x) is int and 0 <= x < (1 << 48) for x in value)


def _numel(size) -> int:
    n = 1
    for s in size:
        n *= s
    return n


def _reader_class(folder: Folder, metadata, index_path: Path):
    """A torch.distributed.checkpoint FileSystemReader that serves the checked `metadata` and reads tensor chunks
    with nano_eval's torch.save reader; a bytes entry (which DCP would unpickle unchecked) is refused."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    class CheckedReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            for item in plan.items:
                fqn = item.storage_index.fqn
                if item.type != LoadItemType.TENSOR:
                    raise CheckpointFileError(index_path, f"the model's {fqn} is stored as pickled bytes, not a "
                                              "tensor (loading it would run pickle on the file's bytes)")
                info = metadata.storage_data[item.storage_index]
                chunk = load_torch(folder.file(info.relative_path), TENSORS, offset=info.offset, length=info.length,
                                   where=f"{folder.root / info.relative_path} (bytes {info.offset}+{info.length}, "
                                         f"{fqn})")
                if not isinstance(chunk, torch.Tensor):
                    raise CheckpointFileError(folder.root / info.relative_path,
                                              f"{fqn}'s chunk holds a {type(chunk).__name__}, not a tensor")
                for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                    chunk = chunk.narrow(dim, start, length)
                target = planner.resolve_tensor(item).detach()
                if target.size() != chunk.size():
                    raise CheckpointFileError(folder.root / info.relative_path, f"{fqn}'s chunk is "
                                              f"{list(chunk.size())}, the model expects {list(target.size())}")
                target.copy_(chunk)
                planner.commit_tensor(item, target)
            done = torch.futures.Future()
            done.set_result(None)
            return done

    return CheckedReader


@contextlib.contextmanager
def _checked_reader(folder: Folder, metadata, index_path: Path):
    """Inside: megatron-core's torch_dist loader reads through `CheckedReader` (see `_reader_class`)."""
    from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

    if not callable(getattr(torch_strategy, "_get_filesystem_reader", None)):
        raise NanoEvalError("this megatron-core version opens torch_dist checkpoints in a way nano_eval cannot "
                            "intercept, and torch would unpickle parts of them unchecked. Fix: use megatron-core "
                            "0.16-0.19, or convert the checkpoint to the legacy format.")
    reader = _reader_class(folder, metadata, index_path)
    original = torch_strategy._get_filesystem_reader
    # (checkpoint_dir, cache_metadata=False), and from 0.17 async_strategy="mcore" too
    torch_strategy._get_filesystem_reader = lambda checkpoint_dir, *args, **kwargs: reader(checkpoint_dir)
    try:
        yield
    finally:
        torch_strategy._get_filesystem_reader = original


def read_common(iter_dir: Path, policy: FilePolicy = FilePolicy(), metadata=None) -> dict:
    """The common state (args, iteration, content metadata) read by nano_eval's own unpickler: `common.pt`, or
    megatron-core 0.19's `common_state` entry of the index (`metadata`: the checked index; read here if None)."""
    folder = Folder(iter_dir, policy)
    if folder.has(COMMON):
        common, where = load_shard(folder.file(COMMON)), folder.root / COMMON
    else:
        metadata = metadata if metadata is not None else _index_or_none(folder, policy)
        common, where = _common_state(folder, metadata)
    content = common.get(CONTENT_METADATA)
    if content is not None and not (isinstance(content, dict) and all(
            isinstance(k, str) and (v is None or type(v) in (bool, int, float, str)) for k, v in content.items())):
        raise CheckpointFileError(where, f"its {CONTENT_METADATA} is not a dict of plain values")
    return common


def _index_or_none(folder: Folder, policy: FilePolicy):
    return read_metadata_safely(folder.root, policy) if folder.has(INDEX) else None


def _common_state(folder: Folder, metadata) -> tuple[dict, Path]:
    """megatron-core 0.19's common state: the bytes of the index's COMMON_STATE entry (a torch.save'd list holding
    one dict), read with nano_eval's torch.save reader; (the dict, where it was)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    if metadata is None or type(metadata.state_dict_metadata.get(COMMON_STATE)) is not BytesStorageMetadata:
        raise CheckpointFileError(folder.root, f"has no {COMMON} and its index has no {COMMON_STATE} entry (they "
                                  "hold the model arguments)", "finish copying the checkpoint, or point at the "
                                  "iter_XXXXXXX folder itself")
    info = metadata.storage_data.get(MetadataIndex(COMMON_STATE))
    if info is None:
        raise CheckpointFileError(folder.root / INDEX, f"its {COMMON_STATE} entry has no storage entry")
    where = folder.root / info.relative_path
    loaded = load_shard(folder.file(info.relative_path), offset=info.offset, length=info.length,
                        where=f"{where} (bytes {info.offset}+{info.length}, {COMMON_STATE})", wrapped_in_list=True)
    return loaded, where


@contextlib.contextmanager
def single_stage_parallel_state():
    """torch.distributed and Megatron's parallel_state at TP1 / PP1 for the load; undoes only what it set up.

    Without a process group: a 1-process gloo group on an in-memory store (no port). Inside a world of N ranks
    (torchrun): every rank must call this; each builds the whole model and loads it (DP = N)."""
    from nano_eval.compat.megatron import (import_megatron_core, initialize_cpu_model_parallel,
                                           reset_model_parallel)

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
            reset_model_parallel()  # its groups too: a sweep loads one checkpoint after another
        if own_world:
            dist.destroy_process_group()


def _model_only(sharded: dict) -> dict:
    """The tensors to load: `_extra_state` objects (Transformer Engine's FP8 bookkeeping) are not weights."""
    from megatron.core.dist_checkpointing import ShardedObject

    return {k: v for k, v in sharded.items() if not k.endswith("_extra_state") and not isinstance(v, ShardedObject)}


def _reason(error: BaseException) -> str:
    """One line: torch's CheckpointException wraps each rank's (error, traceback) (e.g. a global shape mismatch)."""
    error = _inner(error)
    return f"{type(error).__name__}: {(str(error) or repr(error)).strip().splitlines()[-1][:300]}"


@dataclass(frozen=True)
class DistCheckpoint:
    """A torch_dist iteration folder, read and checked: its folder, common.pt, index and args (overrides applied),
    and the bytes of the .distcp files its index uses."""

    folder: Folder
    common: dict
    metadata: object
    args: dict
    data_bytes: int


def open_dist_checkpoint(iter_dir: str | Path, policy: FilePolicy = FilePolicy(),
                         overrides: Mapping | None = None) -> DistCheckpoint:
    """Read the common state and .metadata with nano_eval's readers and check the index and metadata.json (nothing
    is built or allocated for the model yet)."""
    folder = Folder(iter_dir, policy).check()
    metadata = _index_or_none(folder, policy)
    common = read_common(folder.root, policy, metadata)
    if metadata is None:
        metadata = read_metadata_safely(folder.root, policy)  # "has *.distcp files but no .metadata"
    args = {**args_dict(common.get("args")), **dict(overrides or {})}
    data_files = {info.relative_path for info in metadata.storage_data.values()}
    if folder.has("metadata.json"):
        saved = folder.read_json("metadata.json", CONFIG_BYTES)
        backend = saved.get("sharded_backend") if isinstance(saved, dict) else None
        if backend != "torch_dist":
            raise CheckpointFileError(folder.root / "metadata.json", f"says the checkpoint's format is "
                                      f"{backend!r:.40}, not torch_dist (the only distributed format nano_eval reads)",
                                      "convert the checkpoint to torch_dist or legacy, or copy it again")
    return DistCheckpoint(folder, common, metadata, args, sum(folder.file(n).stat().st_size for n in data_files))


def load_sharded(model, ckpt: DistCheckpoint, fix: str) -> dict:
    """megatron-core's dist_checkpointing.load of the model's sharded state dict (weights only) through the checked
    reader: {name: tensor} for this rank's share, resharded from whatever layout the checkpoint was saved in."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    from nano_eval.compat.megatron import common_state_not_reread

    index = ckpt.folder.root / INDEX
    sharded = _model_only(model.sharded_state_dict(metadata=ckpt.common.get(CONTENT_METADATA)))
    _check_requested(sharded, ckpt.metadata, index)
    with _checked_reader(ckpt.folder, ckpt.metadata, index), common_state_not_reread() as how:
        try:
            loaded = dist_checkpointing.load(sharded, str(ckpt.folder.root), **how)
        except CheckpointFileError:
            raise
        except (Exception, CheckpointException) as e:  # torch's CheckpointException is a BaseException
            inner = _inner(e)
            if isinstance(inner, CheckpointFileError):
                raise inner from e
            raise NanoEvalError(f"{ckpt.folder.given}: megatron-core could not load it into the GPTModel its args "
                                f"describe ({_reason(e)}). Fix: {fix}") from e
    return {k: v for k, v in loaded.items() if isinstance(v, torch.Tensor)}


def read_dist_checkpoint(iter_dir: str | Path, overrides: Mapping | None = None,
                         policy: FilePolicy = FilePolicy()) -> tuple[dict, dict]:
    """({Megatron name: full tensor} as one TP1/PP1 GPTModel's state dict, args) of a torch_dist checkpoint.

    overrides: Megatron argument names/values that replace the pickled args (e.g. for an old checkpoint)."""
    ckpt = open_dist_checkpoint(iter_dir, policy, overrides)
    args = ckpt.args
    hf_config_from_args(args, vocab_size=args.get("padded_vocab_size") or 1)  # refuses non-Llama args early
    check_model_size(args, ckpt.folder.root / COMMON, disk_bytes=ckpt.data_bytes, policy=policy)
    with single_stage_parallel_state():
        model = build_gpt_model({**LLAMA_STYLE, **args}, tp=1, pp=1, ep=1)  # the converter's Llama defaults
        loaded = load_sharded(model, ckpt, "check that it is a Llama-style GPT checkpoint; pass megatron_args=... "
                                           "if its args are wrong.")
    return loaded, args


def _check_requested(sharded: dict, metadata, index_path: Path) -> None:
    """Every tensor the model asks for is a tensor in the index (not pickled bytes, which DCP would unpickle)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for value in sharded.values():
        key = getattr(value, "key", None)
        found = metadata.state_dict_metadata.get(key)
        if key is not None and found is not None and type(found) is not TensorStorageMetadata:
            raise CheckpointFileError(index_path, f"the model's {key} is stored as pickled bytes, not a tensor "
                                      "(loading it would run pickle on the file's bytes)")
        if key is not None and found is not None:
            _check_cover(key, found, index_path)


def _check_cover(key: str, md, index_path: Path) -> None:
    """The saved chunks of tensor `key` cover each of its elements exactly once (nano_eval.checkpoints.cover): DCP
    reads only the chunks that exist, so a gap would leave the new model's random values in the weights."""
    problem = cover_problem(tuple(md.size), [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
    if problem is not None:
        raise CheckpointFileError(index_path, f"the chunks of {key} do not cover it exactly once: {problem}")


def _inner(error: BaseException) -> BaseException:
    """The first rank's own error inside torch's CheckpointException (or the error itself)."""
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))
        error = error[0] if isinstance(error, tuple) else error
    return error
