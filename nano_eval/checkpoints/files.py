"""Checks of a checkpoint's own files before a framework reads them, so that a broken file ends in one
`nano_eval: error:` line naming the file and the fix instead of a traceback from deep inside safetensors,
transformers or json: truncated safetensors, unparsable config files, a tokenizer that is missing or does not load.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from nano_eval.checkpoints.untrusted import (CONFIG_BYTES, TOKENIZER_BYTES, CheckpointFileError, FilePolicy,
                                             Folder, parse_json)
from nano_eval.chat_template import MAX_TEMPLATE_CHARS
from nano_eval.checkpoints.tokenizer_probe import check_tokenizer_json, probe_tokenizer
from nano_eval.errors import NanoEvalError, is_rust_panic

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt")


SAFETENSORS_HEADER_BYTES = 100 << 20  # the limit the safetensors library itself enforces
_SAFETENSORS_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                       "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8, "C64": 8}


@dataclass(frozen=True)
class SafetensorsEntry:
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class SafetensorsHeader:
    tensors: dict  # name -> SafetensorsEntry
    metadata: dict  # the header's __metadata__ (str -> str)


def safetensors_header(path: str | Path) -> SafetensorsHeader:
    """The header of a safetensors file, checked: bounded size, every tensor's byte range inside the file and equal
    to its shape x dtype, the file exactly as long as its last tensor. A CheckpointFileError otherwise."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as fh:
        return read_safetensors_header(fh, size, path)


def read_safetensors_header(fh, size: int, path: str | Path) -> SafetensorsHeader:
    """`safetensors_header` of a file already open (`fh` at offset 0, `size` bytes; `path` names it in errors)."""
    path = Path(path)
    head = fh.read(8)
    if len(head) < 8:
        raise CheckpointFileError(path, "is shorter than a safetensors header (truncated or corrupt)")
    (n,) = struct.unpack("<Q", head)
    if n > min(SAFETENSORS_HEADER_BYTES, size - 8):
        raise CheckpointFileError(path, f"declares a {n}-byte header in a {size}-byte file (truncated or corrupt)")
    raw = fh.read(n)
    header = parse_json(raw, path)
    if not isinstance(header, dict):
        raise CheckpointFileError(path, "has a header that is not a JSON object (corrupt)")
    metadata = header.pop("__metadata__", None) or {}
    tensors, end = {}, 0
    for name, entry in header.items():
        try:
            dtype, shape, (start, stop) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
            itemsize = _SAFETENSORS_DTYPES[dtype]
            ok = all(type(x) is int and x >= 0 for x in (*shape, start, stop))
        except (KeyError, TypeError, ValueError):
            raise CheckpointFileError(path, f"has a malformed header entry {name!r:.60} (corrupt)") from None
        t = SafetensorsEntry(dtype, shape, itemsize)
        if not ok or stop - start != t.numel * itemsize or stop < start:
            raise CheckpointFileError(path, f"says {name!r:.60} is {list(shape)} {dtype} in bytes {start}..{stop} "
                                      "(corrupt)")
        tensors[name], end = t, max(end, stop)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFileError(path, "has __metadata__ that is not strings (corrupt)")
    if size != 8 + n + end:
        raise CheckpointFileError(path, f"is {size} bytes but its header says {8 + n + end} (truncated or corrupt)")
    return SafetensorsHeader(tensors, metadata)


def safetensors_problem(path: str | Path) -> str | None:
    """Why the safetensors file at `path` cannot be complete or correct (None when its header checks out)."""
    try:
        safetensors_header(path)
    except CheckpointFileError as e:
        return f"{Path(path).name} {e.what}"
    except OSError as e:
        return f"{Path(path).name} cannot be read ({e.strerror})"
    return None


def check_safetensors(files, checkpoint: str | Path) -> None:
    """NanoEvalError naming the first truncated or corrupt safetensors file among `files`."""
    for f in files:
        problem = safetensors_problem(f)
        if problem is not None:
            raise NanoEvalError(f"checkpoint {checkpoint}: {Path(f)} is truncated or corrupt ({problem}). Fix: copy or save the checkpoint again (the file was cut short or "
                                "damaged, e.g. by a full disk or a killed copy).")


def read_json_file(folder: Folder, name: str, what: str, limit: int = CONFIG_BYTES) -> dict:
    """The JSON object in the folder's file `name` (checked: inside, regular, bounded; see untrusted.py)."""
    data = folder.read_json(name, limit)
    if not isinstance(data, dict):
        raise CheckpointFileError(folder.root / name, f"holds a JSON {type(data).__name__}, not an object ({what})",
                                  "restore the file from the run that saved the checkpoint")
    return data


def check_tokenizer_folder(folder: Folder) -> None:
    """The tokenizer files transformers will open: present, parseable, and every file a config names (`vocab_file`,
    `merges_file`, `tokenizer_file`, ...) a file of this folder: tokenizer_config.json may name any path, and
    transformers would open it."""
    if not any(folder.has(f) for f in TOKENIZER_FILES):
        raise CheckpointFileError(folder.given, f"holds no tokenizer (none of {', '.join(TOKENIZER_FILES)})",
                                  "pass --tokenizer PATH_OR_HUB_ID (the tokenizer the model was trained with)")
    for name in ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json"):
        if folder.has(name):
            config = read_json_file(folder, name, "tokenizer")
            for key, value in config.items():
                if key.endswith(("_file", "_files")) and value is not None:
                    if not isinstance(value, str) or Path(value).name != value or value in (".", ".."):
                        raise CheckpointFileError(folder.root / name, f"names {key}={value!r:.100}, not a file of "
                                                  "the tokenizer folder", f"remove {key} from {name}")
                    folder.file(value)
    templates = [name for name in ("chat_template.jinja", "chat_template.json") if folder.has(name)]
    if (folder.root / "additional_chat_templates").is_dir():
        templates += [f"additional_chat_templates/{p.name}" for p in sorted(
            (folder.root / "additional_chat_templates").iterdir())]
    for name in templates:  # transformers reads them whole; nano_eval refuses longer templates anyway
        folder.read_bytes(name, 4 * MAX_TEMPLATE_CHARS)
    if folder.has("tokenizer.json"):
        data = folder.read_json("tokenizer.json", TOKENIZER_BYTES)
        if isinstance(data, dict):
            check_tokenizer_json(data, folder.root / "tokenizer.json")


def load_tokenizer(source: str, checkpoint: str | Path, *, trust_remote_code: bool = False,
                   policy: FilePolicy = FilePolicy()):
    """AutoTokenizer.from_pretrained(source), with one clear error naming `source` and `--tokenizer` when it
    fails or panics (`checkpoint`: what is being loaded, for the message). A local folder is checked first as
    untrusted input (check_tokenizer_folder); a name that is not a local path is a Hub id. The loaded tokenizer is
    probed (tokenizer_probe.probe_tokenizer) before any task text is given to it."""
    from transformers import AutoTokenizer

    local = Path(source).expanduser()
    fix = "Fix: pass --tokenizer PATH_OR_HUB_ID (the tokenizer the model was trained with)."
    if local.exists():
        folder = Folder(local, policy, what="tokenizer").check()
        try:
            check_tokenizer_folder(folder)
        except CheckpointFileError as e:
            raise CheckpointFileError(e.path, f"{e.what} (tokenizer of checkpoint {checkpoint})",
                                      fix.removeprefix("Fix: ").rstrip(".")) from e
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else source,
                                                  trust_remote_code=trust_remote_code)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 -- OSError, ValueError, tokenizers' own errors and Rust panics
        if not isinstance(e, Exception) and not is_rust_panic(e):
            raise
        first = " ".join(str(e).split())[:300]
        raise NanoEvalError(f"checkpoint {checkpoint}: the tokenizer {source} does not load ({type(e).__name__}: "
                            f"{first}). {fix}") from None
    probe_tokenizer(tokenizer, repr(source))
    return tokenizer
