"""Read pickled checkpoint files (torch.save archives, torch_dist's `.metadata`) without trusting them.

A pickle is a program: its GLOBAL opcodes import any name, REDUCE calls it, BUILD writes attributes on whatever is on
the stack (a class, an enum member: process-wide state). torch's `weights_only=True` narrows the names but still
builds allow-listed classes, runs BUILD on enum members and trusts the sizes a file declares. Here, by construction:

- **Nothing is imported by name.** `find_class` answers from a table (`Allowed.real`): nano_eval's own inert types,
  torch.Size / dtypes / layouts, set / frozenset / slice / OrderedDict and (for `.metadata` only) the
  torch.distributed.checkpoint metadata and save-plan dataclasses. Names a genuine checkpoint carries but nano_eval never uses
  (numpy RNG arrays, Megatron's enums, paths, signals) become `Opaque` records: a name, nothing imported or called.
  Every other name is refused.
- **BUILD only fills fresh objects of listed types** (argument namespaces, the metadata dataclasses, by their own
  field names); never a class, an enum member or anything shared.
- **Tensors come from their own bytes** (torch_files.py reads each storage from its record): a tensor view must lie
  inside its storage and hold no more elements than it (no stride-0 expansion); meta, sparse and quantized tensors
  and tensor subclasses are refused.

`unpickle(data, allowed)` reads a plain pickle (torch_dist's `.metadata`); torch_files.py reads torch.save
archives with it. Failures are CheckpointFileError naming the file.
"""

from __future__ import annotations

import argparse
import io
import pickle
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

import torch

from nano_eval.checkpoints.untrusted import CheckpointFileError

PICKLE_BYTES = 1 << 30  # data.pkl / .metadata: structure only, never the tensors' bytes
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class Opaque:
    """A value a checkpoint pickled that nano_eval never uses (an enum member, a numpy array, a path): its name only.
    Nothing was imported, called or built for it; calling it (REDUCE) gives another Opaque."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs) -> "Opaque":
        return Opaque(self.name)

    def __repr__(self) -> str:
        return f"<{self.name}>"


class CheckpointArgs(argparse.Namespace):
    """Training arguments (argparse.Namespace / SimpleNamespace) as a checkpoint pickled them: plain attributes."""


@dataclass(frozen=True)
class StorageType:
    dtype: torch.dtype


class Storage:
    """A storage read from its record: `data` is a 1-D tensor of `dtype` holding exactly the record's bytes."""

    __slots__ = ("data",)

    def __init__(self, data: torch.Tensor):
        self.data = data


def _tensor_view(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2, checked: the view lies inside its storage and holds no more elements."""
    if not isinstance(storage, Storage):
        raise pickle.UnpicklingError(f"a tensor's storage is a {type(storage).__name__}")
    ints = (storage_offset, *size, *stride)
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride)
            and all(type(x) is int and x >= 0 for x in ints)):
        raise pickle.UnpicklingError(f"a tensor declares size {size!r}, stride {stride!r}, offset {storage_offset!r}")
    have = storage.data.numel()
    numel = 1
    for s in size:
        numel *= s
    if numel > have:
        raise pickle.UnpicklingError(f"a tensor of {numel} elements is declared on a storage of {have} (repeated "
                                     "elements, e.g. a stride of 0)")
    if numel and storage_offset + sum((s - 1) * st for s, st in zip(size, stride)) >= have:
        raise pickle.UnpicklingError(f"a tensor of size {list(size)} and stride {list(stride)} at offset "
                                     f"{storage_offset} reaches past its storage of {have} elements")
    return storage.data.as_strided(size, stride, storage_offset)


def _parameter(data, requires_grad=False, backward_hooks=None, *rest):
    """torch._utils._rebuild_parameter: the tensor itself (a checkpoint's parameters are loaded as plain tensors)."""
    if not isinstance(data, torch.Tensor):
        raise pickle.UnpicklingError(f"a parameter holds a {type(data).__name__}")
    return data


def _latin1(text, encoding="latin1"):
    """_codecs.encode as protocol 2 pickles bytes: latin-1 only (another codec name would look a codec up)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is allowed for latin-1 bytes only")
    return text.encode("latin1")


def _size(*args):
    if len(args) != 1 or not all(type(x) is int for x in args[0]):
        raise pickle.UnpicklingError("torch.Size of something other than integers")
    return torch.Size(args[0])


def _device(*args):
    if len(args) not in (1, 2) or not isinstance(args[0], str) or (len(args) == 2 and type(args[1]) is not int):
        raise pickle.UnpicklingError("torch.device of something other than a name")
    return torch.device(*args)


def _plain_path(*parts):
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError("a path of something other than strings")
    return PurePosixPath(*parts)


@dataclass(frozen=True)
class Allowed:
    """What one kind of file may name. real: (module, name) -> what find_class returns; opaque: names turned into
    Opaque; buildable: types whose fresh instances BUILD may fill (dataclasses by field name)."""

    real: dict
    opaque: Callable[[str, str], bool] = lambda module, name: False
    buildable: tuple = ()
    storages: bool = False  # BINPERSID storages (torch.save archives)
    extra_fields: dict = None  # type -> attribute names BUILD may set besides a dataclass's fields


def _dtype_names() -> dict:
    return {("torch", str(d).removeprefix("torch.")): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


_STORAGE_TYPES = {("torch", name): StorageType(dtype)
                  for dtype, name in torch.storage._dtype_to_storage_type_map().items()
                  if dtype.is_floating_point or dtype.is_complex or dtype in (torch.int64, torch.int32, torch.int16,
                                                                               torch.int8, torch.uint8, torch.bool)}

_TENSOR_NAMES = {
    **_dtype_names(), **_STORAGE_TYPES,
    ("torch._utils", "_rebuild_tensor_v2"): _tensor_view,
    ("torch._utils", "_rebuild_parameter"): _parameter,
    ("torch", "Size"): _size, ("torch", "device"): _device,
    ("collections", "OrderedDict"): OrderedDict,
    ("_codecs", "encode"): _latin1,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
}

# A state dict (pytorch_model.bin, a .distcp chunk): tensors in (ordered) dicts.
TENSORS = Allowed(real=_TENSOR_NAMES, buildable=(OrderedDict,), storages=True)

# Names genuine Megatron checkpoints carry that nano_eval never uses: numpy RNG state, paths, signals, buffers.
_OPAQUE_NAMES = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("signal", "Signals"), ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "Path"), ("_io", "BytesIO"),
})


def _megatron_opaque(module: str, name: str) -> bool:
    """Megatron's and Transformer Engine's own enums and config classes (capitalised names, no attribute chains),
    numpy's dtype classes, and _OPAQUE_NAMES."""
    if (module, name) in _OPAQUE_NAMES:
        return True
    if not _IDENTIFIER.match(name) or not name[0].isupper():  # "os.system" under an allowed module: refused
        return False
    return module == "numpy.dtypes" and name.endswith("DType") or module.startswith(
        ("megatron.core.", "megatron.training.", "transformer_engine."))


# A Megatron legacy shard or common.pt: a state dict, the training args, RNG state, optimizer state.
MEGATRON = Allowed(
    real={**_TENSOR_NAMES, ("argparse", "Namespace"): CheckpointArgs, ("types", "SimpleNamespace"): CheckpointArgs},
    opaque=_megatron_opaque, buildable=(OrderedDict, CheckpointArgs), storages=True)


def dcp_index() -> Allowed:
    """A torch_dist `.metadata`: torch.distributed.checkpoint's index dataclasses and plain values."""
    from torch.distributed.checkpoint import filesystem, metadata as m, planner

    classes = (m.Metadata, m.TensorStorageMetadata, m.BytesStorageMetadata, m.ChunkStorageMetadata,
               m.TensorProperties, m.MetadataIndex, m.StorageMeta, filesystem._StorageInfo,
               # megatron-core's own file writer (Megatron-LM's default save) also keeps every rank's save plan in
               # the index (`Metadata.all_local_plans`): plain dataclasses, never used by nano_eval
               planner.SavePlan, planner.WriteItem, planner.TensorWriteData)
    real = {(c.__module__, c.__qualname__): c for c in classes}
    real |= {(m.__name__, "_MEM_FORMAT_ENCODING"): m._MEM_FORMAT_ENCODING,  # enum: calling it looks a member up
             (planner.__name__, "WriteItemType"): planner.WriteItemType,  # enum, likewise
             ("torch.serialization", "_get_layout"): _layout, ("pathlib", "PosixPath"): _plain_path,
             ("pathlib", "PurePosixPath"): _plain_path}
    real |= {k: v for k, v in _TENSOR_NAMES.items() if not isinstance(v, StorageType) and v is not _tensor_view
             and v is not _parameter}
    # megatron-core versions that reformulate N-D tensors record it on the Metadata as `mcore_data` (a plain dict);
    # its file writer adds `all_local_plans` (the save plans above)
    return Allowed(real=real, buildable=classes + (OrderedDict,),
                   extra_fields={m.Metadata: {"mcore_data", "all_local_plans"}})


def _layout(name):
    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if name not in layouts:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return layouts[name]


# torch names a checkpoint of weights never needs, refused with the reason rather than as merely unknown
_TORCH_REFUSALS = {
    ("torch._utils", "_rebuild_meta_tensor_no_storage"): "a meta tensor (a shape with no data)",
    ("torch._utils", "_rebuild_sparse_tensor"): "a sparse tensor",
    ("torch._utils", "_rebuild_qtensor"): "a quantized tensor",
    ("torch._utils", "_rebuild_wrapper_subclass"): "a tensor subclass",
    ("torch._tensor", "_rebuild_from_type_v2"): "a tensor subclass or a tensor with Python attributes",
    ("torch._utils", "_rebuild_parameter_with_state"): "a parameter with Python state",
}


class _Unpickler(pickle._Unpickler):
    """Python's own unpickler with every opcode that reaches outside the data answered by `allowed`."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file, allowed: Allowed, storage: Callable | None = None):
        super().__init__(file, encoding="latin1")
        self._input_size = len(file.getbuffer())  # an io.BytesIO of the whole pickle
        self.allowed = allowed
        self.callable_ids = {id(v) for v in allowed.real.values()}
        self.storage = storage
        self.fresh: set[int] = set()  # ids of objects this load created with NEWOBJ / REDUCE of a buildable type

    def find_class(self, module, name):
        found = self.allowed.real.get((module, name))
        if found is not None:
            return found
        if self.allowed.opaque(module, name):
            return Opaque(f"{module}.{name}")
        if (module, name) in _TORCH_REFUSALS:
            raise pickle.UnpicklingError(f"it holds {_TORCH_REFUSALS[module, name]} ({module}.{name}), which a "
                                         "checkpoint of weights never needs")
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint")

    def persistent_load(self, pid):
        if self.storage is None or not self.allowed.storages:
            raise pickle.UnpicklingError("persistent ids are not allowed here")
        return self.storage(pid)

    def _new(self, cls, args, kwargs=None):
        if id(cls) not in self.callable_ids and not isinstance(cls, Opaque):
            raise pickle.UnpicklingError(f"cannot create a {getattr(cls, '__name__', type(cls).__name__)}")
        if isinstance(cls, Opaque):
            return cls()
        obj = cls.__new__(cls, *args, **(kwargs or {}))
        self.fresh.add(id(obj))
        return obj

    def load_newobj(self):
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._new(cls, args))
    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self):
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.append(self._new(cls, args, kwargs))
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def load_reduce(self):
        args = self.stack.pop()
        func = self.stack[-1]
        if not isinstance(func, Opaque) and id(func) not in self.callable_ids:
            raise pickle.UnpicklingError(f"cannot call {func!r}")
        if not isinstance(args, tuple):
            raise pickle.UnpicklingError("REDUCE arguments are not a tuple")
        result = func(*args)
        if isinstance(func, type) and isinstance(result, self.allowed.buildable):
            self.fresh.add(id(result))
        self.stack[-1] = result
    dispatch[pickle.REDUCE[0]] = load_reduce

    def load_build(self):
        state = self.stack.pop()
        inst = self.stack[-1]
        if isinstance(inst, Opaque):
            return
        if id(inst) not in self.fresh or not isinstance(inst, self.allowed.buildable) or isinstance(inst, type):
            raise pickle.UnpicklingError(f"BUILD on a {type(inst).__name__} is not allowed")
        if isinstance(inst, OrderedDict):
            return  # a state dict's `_metadata` (module versions): not needed
        own_setstate = type(inst).__dict__.get("__setstate__")
        if own_setstate is not None:  # torch.distributed.checkpoint's TensorProperties: a tuple of plain values
            own_setstate(inst, state)
            return
        if not isinstance(state, dict) or not all(type(k) is str and not k.startswith("__") for k in state):
            raise pickle.UnpicklingError(f"BUILD of a {type(inst).__name__} with {type(state).__name__} state")
        if is_dataclass(inst):
            extra = (self.allowed.extra_fields or {}).get(type(inst), set())
            unknown = set(state) - {f.name for f in fields(inst)} - extra
            if unknown:
                raise pickle.UnpicklingError(f"{type(inst).__name__} has no fields {sorted(unknown)}")
        inst.__dict__.update(state)
    dispatch[pickle.BUILD[0]] = load_build

    def _refuse(self):
        raise pickle.UnpicklingError("INST / OBJ / EXT / PERSID opcodes are not allowed in a checkpoint")
    for _op in (pickle.INST, pickle.OBJ, pickle.EXT1, pickle.EXT2, pickle.EXT4, pickle.PERSID):
        dispatch[_op[0]] = _refuse
    del _op

    def load_append(self):
        value = self.stack.pop()
        self._target(list).append(value)
    dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self):
        items = self.pop_mark()
        self._target(list).extend(items)
    dispatch[pickle.APPENDS[0]] = load_appends

    def load_setitem(self):
        value = self.stack.pop()
        key = self.stack.pop()
        self._target(dict)[key] = value
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self):
        items = self.pop_mark()
        target = self._target(dict)
        for i in range(0, len(items), 2):
            target[items[i]] = items[i + 1]
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_additems(self):
        items = self.pop_mark()
        self._target(set).update(items)
    dispatch[pickle.ADDITEMS[0]] = load_additems

    def load_bytearray8(self):
        """BYTEARRAY8 with its length checked first: Python's own allocates the declared length (up to 2**63 bytes)
        before reading, so one flipped byte asked for gigabytes."""
        (size,) = struct.unpack("<Q", self.read(8))
        if size > self._input_size:
            raise pickle.UnpicklingError(f"BYTEARRAY8 declares {size:,} bytes, more than the {self._input_size:,} "
                                         "bytes of the whole pickle")
        self.append(bytearray(self.read(size)))
    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8

    def _target(self, kind: type):
        target = self.stack[-1]
        if type(target) is not kind and not (kind is dict and type(target) is OrderedDict):
            raise pickle.UnpicklingError(f"cannot add items to a {type(target).__name__}")
        return target


def unpickle(data: bytes, allowed: Allowed, where: str | Path, storage: Callable | None = None):
    """The object pickled in `data`, under `allowed`; CheckpointFileError naming `where` if it is refused."""
    try:
        return _Unpickler(io.BytesIO(data), allowed, storage).load()
    except CheckpointFileError:
        raise
    except RecursionError as e:
        raise CheckpointFileError(where, "nests objects deeper than a checkpoint does") from e
    except Exception as e:  # noqa: BLE001 - a refused name, a malformed opcode stream, a bad size: not loadable
        raise CheckpointFileError(where, f"refused to load ({type(e).__name__}: {first_line(e)}); nothing in it "
                                  "was run") from e


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (text[0] if text else repr(error))[:300]
