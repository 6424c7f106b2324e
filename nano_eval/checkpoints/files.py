"""Checks of a checkpoint's own files before a framework reads them, so that a broken file ends in one
`nano_eval: error:` line naming the file and the fix instead of a traceback from deep inside safetensors,
transformers or json: truncated safetensors, unparsable config files, a tokenizer that is missing or does not load.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from nano_eval.errors import NanoEvalError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model",
                   "vocab.txt")


def safetensors_problem(path: str | Path) -> str | None:
    """Why the safetensors file at `path` cannot be complete (None when its size matches its header).

    A safetensors file is 8 bytes of header length n, n bytes of JSON header, then the tensors; its size is
    8 + n + the end offset of its last tensor."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, struct.error, KeyError, TypeError, AttributeError, IndexError):
        return f"{path.name} has an incomplete or unreadable header"
    size = path.stat().st_size
    if size != 8 + n + end:
        return f"{path.name} is {size} bytes but its header says {8 + n + end}"
    return None


def check_safetensors(files, checkpoint: str | Path) -> None:
    """NanoEvalError naming the first truncated or corrupt safetensors file among `files`."""
    for f in files:
        problem = safetensors_problem(f)
        if problem is not None:
            raise NanoEvalError(f"checkpoint {checkpoint}: {Path(f)} is truncated or corrupt ({problem}). Fix: copy "
                                "or save the checkpoint again (the file was cut short, e.g. by a full disk or a "
                                "killed copy).")


def read_json_file(path: str | Path, what: str) -> dict:
    """The JSON object in `path`; a NanoEvalError naming the file, line and column if it does not parse."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise NanoEvalError(f"{what}: {path} is not valid JSON (line {e.lineno} column {e.colno}: {e.msg}). Fix: "
                            "restore the file from the run that saved the checkpoint.") from e
    except (OSError, UnicodeDecodeError) as e:
        raise NanoEvalError(f"{what}: cannot read {path} ({e}). Fix: restore the file.") from e
    if not isinstance(data, dict):
        raise NanoEvalError(f"{what}: {path} holds a JSON {type(data).__name__}, not an object. Fix: restore the "
                            "file from the run that saved the checkpoint.")
    return data


def load_tokenizer(source: str, checkpoint: str | Path, *, trust_remote_code: bool = False):
    """AutoTokenizer.from_pretrained(source), with one clear error naming `source` and `--tokenizer` when it
    fails (`checkpoint`: what is being loaded, for the message)."""
    from transformers import AutoTokenizer

    local = Path(source).expanduser()
    fix = "Fix: pass --tokenizer PATH_OR_HUB_ID (the tokenizer the model was trained with)."
    if local.is_dir() and not any((local / f).exists() for f in TOKENIZER_FILES):
        raise NanoEvalError(f"checkpoint {checkpoint}: no tokenizer in {local} (none of {', '.join(TOKENIZER_FILES)}). "
                            f"{fix}")
    for name in ("tokenizer_config.json", "tokenizer.json"):
        if local.is_dir() and (local / name).exists():
            read_json_file(local / name, f"checkpoint {checkpoint}: tokenizer")
    try:
        return AutoTokenizer.from_pretrained(str(local) if local.exists() else source,
                                             trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 -- OSError, ValueError, tokenizers' own errors: all end in the same advice
        first = " ".join(str(e).split())[:300]
        raise NanoEvalError(f"checkpoint {checkpoint}: the tokenizer {source} does not load ({type(e).__name__}: "
                            f"{first}). {fix}") from e
