"""Read torch.save archives (Megatron shards, common.pt, pytorch_model.bin, torch_dist chunks) without torch.load.

A torch.save file is a zip archive: `<name>/data.pkl` (the pickled structure) and one record `<name>/data/<key>` per
storage. Here the archive must be uncompressed with records that do not overlap (a zip bomb cannot expand); each
storage's record must hold exactly `numel x itemsize` bytes and is read straight into a tensor of that size;
data.pkl goes through nano_eval's unpickler (pickles.py) under an allow-list. TorchScript archives and the pre-1.6
tar format are refused. `load_torch(path)` reads a whole file, `load_torch(path, offset=, length=)` a torch.save
stream inside a file (a torch_dist `.distcp` chunk).
"""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path

import torch

from nano_eval.checkpoints.pickles import (PICKLE_BYTES, TENSORS, Allowed, Storage, StorageType, first_line,
                                          unpickle)
from nano_eval.checkpoints.untrusted import CheckpointFileError

_RECORD_KEY = re.compile(r"^[A-Za-z0-9_]+$")
_ZIP_LOCAL_HEADER = struct.Struct("<4s2B4HL2L2H")


class _Window(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file, as a seekable file of their own."""

    def __init__(self, fh, offset: int, length: int):
        self.fh, self.offset, self.length, self.pos = fh, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.fh.seek(self.offset + self.pos)
        got = self.fh.readinto(memoryview(buffer)[:n]) if n else 0
        self.pos += got
        return got


def load_torch(path: str | Path, allowed: Allowed = TENSORS, *, offset: int = 0, length: int | None = None,
               where: str | Path | None = None):
    """The object a torch.save archive holds: the whole file at `path`, or the `length` bytes at `offset` (a
    torch_dist chunk). Tensors are plain CPU tensors read from the archive's own records (see the module doc)."""
    path = Path(path)
    where = where or path
    size = os.path.getsize(path)
    length = size - offset if length is None else length
    if offset < 0 or length < 0 or offset + length > size:
        raise CheckpointFileError(where, f"declares bytes {offset}..{offset + length} of a {size}-byte file")
    with path.open("rb") as fh:
        window = _Window(fh, offset, length)
        head = window.read(4)
        window.seek(0)
        if head[:4] != b"PK\x03\x04":
            what = "an empty file" if length == 0 else (
                "the pre-1.6 torch format (a tar or raw pickle)" if head[:1] in (b"\x80", b"q") or length > 262 and
                _is_tar(window) else "not a torch.save archive (no zip header)")
            raise CheckpointFileError(where, f"is {what}", "re-save it with torch >= 1.6 (torch.save), or copy the "
                                      "file again")
        try:
            archive = zipfile.ZipFile(window)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as e:
            raise CheckpointFileError(where, f"is a damaged zip archive ({first_line(e)})") from e
        with archive:
            return _read_archive(archive, window, allowed, where, length)


def _is_tar(window) -> bool:
    window.seek(257)
    magic = window.read(5)
    window.seek(0)
    return magic == b"ustar"


def _read_archive(archive: zipfile.ZipFile, window: _Window, allowed: Allowed, where, length: int):
    infos = archive.infolist()
    pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
    if len(pickles) != 1:
        raise CheckpointFileError(where, "is a zip archive but not one torch.save wrote (no single <name>/data.pkl)")
    prefix = pickles[0].filename[: -len("data.pkl")]
    if any(i.filename.startswith((prefix + "code/", prefix + "constants.pkl")) for i in infos):
        raise CheckpointFileError(where, "is a TorchScript archive (it holds code), not a checkpoint",
                                  "save the model's state_dict() with torch.save instead")
    spans = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise CheckpointFileError(where, f"has a compressed record {info.filename} (torch.save never compresses; "
                                      "a compressed record can expand without bound)")
        spans.append((_data_start(window, info, where), info.compress_size, info.filename))
    spans.sort()
    for (start, n, name), (next_start, _, next_name) in zip(spans, spans[1:]):
        if start + n > next_start:
            raise CheckpointFileError(where, f"has overlapping records {name} and {next_name}")
    if spans and spans[-1][0] + spans[-1][1] > length:
        raise CheckpointFileError(where, f"has a record {spans[-1][2]} that reaches past the end of the file")
    starts = {name: (start, n) for start, n, name in spans}
    byteorder = prefix + "byteorder"
    if byteorder in starts and archive.read(byteorder) not in (b"little", b""):
        raise CheckpointFileError(where, "was saved on a big-endian machine", "re-save it on a little-endian one")
    pkl_start, pkl_len = starts[prefix + "data.pkl"]
    if pkl_len > PICKLE_BYTES:
        raise CheckpointFileError(where, f"has a {pkl_len}-byte data.pkl, more than a checkpoint's structure needs")
    window.seek(pkl_start)
    data = window.read(pkl_len)
    loaded: dict[str, Storage] = {}

    def storage(pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"persistent id {pid!r:.80} is not a storage")
        _, storage_type, key, location, numel = pid
        if not isinstance(storage_type, StorageType):
            raise pickle.UnpicklingError(f"storage type {storage_type!r:.80} is not one a checkpoint uses")
        if not (isinstance(key, str) and _RECORD_KEY.match(key)) or type(numel) is not int or numel < 0:
            raise pickle.UnpicklingError(f"storage {key!r:.40} of {numel!r:.40} elements")
        if not isinstance(location, str) or not location.startswith(("cpu", "cuda", "xpu", "mps", "hpu", "npu")):
            raise pickle.UnpicklingError(f"storage {key} is on {location!r:.40} (meta or unknown device)")
        if key in loaded:
            if loaded[key].data.dtype != storage_type.dtype or loaded[key].data.numel() != numel:
                raise pickle.UnpicklingError(f"storage {key} is declared twice differently")
            return loaded[key]
        record = prefix + "data/" + key
        if record not in starts:
            raise pickle.UnpicklingError(f"storage {key} has no record {record}")
        start, n = starts[record]
        itemsize = torch.empty((), dtype=storage_type.dtype).element_size()
        if numel * itemsize != n:
            raise pickle.UnpicklingError(f"storage {key} declares {numel} x {itemsize} bytes but its record holds {n}")
        buffer = torch.empty(n, dtype=torch.uint8)
        window.seek(start)
        if n and window.readinto(buffer.numpy()) != n:
            raise pickle.UnpicklingError(f"storage {key} is cut short")
        loaded[key] = Storage(buffer.view(storage_type.dtype) if n else torch.empty(0, dtype=storage_type.dtype))
        return loaded[key]

    return unpickle(data, allowed, where, storage)


def _data_start(window: _Window, info: zipfile.ZipInfo, where) -> int:
    """Where a record's bytes begin: after its local header (whose name and extra field lengths may differ from the
    central directory's)."""
    window.seek(info.header_offset)
    header = window.read(_ZIP_LOCAL_HEADER.size)
    if len(header) != _ZIP_LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise CheckpointFileError(where, f"has a damaged zip entry {info.filename}")
    name_len, extra_len = struct.unpack("<2H", header[26:30])
    return info.header_offset + _ZIP_LOCAL_HEADER.size + name_len + extra_len
