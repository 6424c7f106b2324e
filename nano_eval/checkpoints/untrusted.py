"""A checkpoint folder (and a tokenizer folder) is untrusted input: the one place its files are opened.

`Folder(root, policy)` walks the folder once (`check`) and refuses what a checkpoint never needs: a symlink that
leaves the folder (unless `--allow-symlinks-outside`), FIFOs, sockets and devices (opening them can hang), more
entries than any checkpoint has. Every file nano_eval itself reads goes through `Folder.file` (resolved, inside,
regular) and the size-checked readers below, so a config that is a FIFO, a YAML alias bomb or a JSON nested past
the interpreter's recursion limit end in one error line instead of a hang, a MemoryError or a traceback.

`FilePolicy.max_bytes` caps what a loader may allocate for a checkpoint's tensors (default: this machine's
physical memory); loaders compare declared sizes with it, and with the bytes on disk, before allocating.
Errors are `CheckpointFileError`: `<file>: <what>. Fix: <what to do>`, exit code 2.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from nano_eval.errors import NanoEvalError
from nano_eval.local_files import YamlShapeError, compose_yaml, kind_of

MAX_ENTRIES = 200_000  # files and folders under one checkpoint (a 1000-layer nanotron checkpoint has ~20k)
CONFIG_BYTES = 64 << 20  # config.json, config.yaml, checkpoint_metadata.json, index files ...
TOKENIZER_BYTES = 512 << 20  # tokenizer.json of a large vocabulary is ~30 MB
YAML_NODES = 1_000_000  # nodes of a YAML document once its aliases are expanded
# Values of a JSON document, counted from its `{`, `[` and `,` before parsing: Python holds each in 30-70 bytes
# (`[{},{},...]` takes 26x its size), so this bounds a parse at ~1 GB. The largest genuine files (tokenizer.json
# of a 256k vocabulary, a safetensors header of thousands of tensors) have ~2M.
JSON_NODES = 12_000_000


class CheckpointFileError(NanoEvalError):
    """A checkpoint or tokenizer file that cannot be loaded safely: `<file>: <what>. Fix: ...` on one line (a
    parser's multi-line message is folded), exit code 2."""

    def __init__(self, path: str | Path, what: str, fix: str = "copy the checkpoint again from the run that saved "
                 "it, or from a source you trust"):
        what = " ".join(str(what).split())
        super().__init__(f"{path}: {what}. Fix: {fix}.")
        self.path, self.what, self.fix = str(path), what, fix

    def __reduce__(self):  # torch.distributed.checkpoint passes a reader's errors between ranks by pickling them
        return type(self), (self.path, self.what, self.fix)


@dataclass(frozen=True, kw_only=True)
class FilePolicy:
    """What a loader may do with a checkpoint's files.

    allow_symlinks_outside: follow symlinks that leave the checkpoint (or tokenizer) folder (off: refused by name).
    max_bytes: the most bytes a loader may allocate for the model's tensors (None: this machine's physical memory).
    """

    allow_symlinks_outside: bool = False
    max_bytes: int | None = None

    def byte_limit(self) -> int:
        if self.max_bytes is not None:
            return self.max_bytes
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return 1 << 40

    def check_allocation(self, nbytes: int, path: str | Path, what: str) -> None:
        """Refuse before allocating `nbytes` for `what` when it is over the limit."""
        if nbytes > self.byte_limit():
            raise CheckpointFileError(path, f"{what} would need {_size(nbytes)}, over the limit of "
                                      f"{_size(self.byte_limit())}", "if the checkpoint is genuine and this machine "
                                      "has the memory, raise --max-checkpoint-bytes")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class Folder:
    """A checkpoint's or tokenizer's folder; `check()` once, then open its files through `file` and the readers."""

    def __init__(self, root: str | Path, policy: FilePolicy = FilePolicy(), *, what: str = "checkpoint"):
        self.given = Path(root)
        self.root = Path(os.path.realpath(root))
        self.policy = policy
        self.what = what

    def check(self) -> "Folder":
        """Walk the folder (without following links): only folders, regular files and links to them inside."""
        if not self.root.is_dir():
            raise CheckpointFileError(self.given, f"the {self.what} folder does not exist or is not a folder",
                                      f"pass the {self.what} folder")
        count = 0
        for top, dirs, files in os.walk(self.root, followlinks=False):
            for name in dirs + files:
                count += 1
                if count > MAX_ENTRIES:
                    raise CheckpointFileError(self.given, f"holds more than {MAX_ENTRIES} files and folders, more "
                                              f"than any {self.what}", f"point at the {self.what} folder itself")
                self._check_entry(Path(top) / name)
        return self

    def _check_entry(self, path: Path) -> None:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            target = Path(os.path.realpath(path))
            if not self.inside(target) and not self.policy.allow_symlinks_outside:
                raise CheckpointFileError(path, f"is a symlink to {target}, outside the {self.what} folder "
                                          f"{self.root}", "copy the file into the folder, or pass "
                                          "--allow-symlinks-outside if you trust where it points")
            try:
                st = os.stat(path)
            except OSError as e:
                raise CheckpointFileError(path, f"is a broken symlink ({e.strerror})", "restore the file") from e
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise CheckpointFileError(path, f"is a {kind_of(st.st_mode)}, not a regular file (reading it could hang)",
                                      f"remove it from the {self.what} folder")

    def inside(self, path: Path) -> bool:
        return path == self.root or self.root in path.parents

    def file(self, name: str | Path) -> Path:
        """The regular file `name` (relative to the folder, or a path under it), resolved and checked."""
        path = self.root / name if not Path(name).is_absolute() else Path(name)
        resolved = Path(os.path.realpath(path))
        if not self.inside(resolved) and not (self.policy.allow_symlinks_outside and self.inside(
                Path(os.path.realpath(path.parent)))):
            raise CheckpointFileError(path, f"resolves to {resolved}, outside the {self.what} folder {self.root}",
                                      "keep every file of the checkpoint inside its folder (or pass "
                                      "--allow-symlinks-outside for symlinks you trust)")
        try:
            st = os.stat(resolved)
        except OSError as e:
            raise CheckpointFileError(path, f"cannot be read ({e.strerror})", "restore the file") from e
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFileError(path, f"is a {kind_of(st.st_mode)}, not a regular file", "restore the file")
        return resolved

    def has(self, name: str | Path) -> bool:
        """`name` exists in the folder (as anything: `file` says whether it may be read)."""
        return os.path.lexists(self.root / name)

    def read_bytes(self, name: str | Path, limit: int) -> bytes:
        path = self.file(name)
        size = path.stat().st_size
        if size > limit:
            raise CheckpointFileError(self.root / name, f"is {_size(size)}, more than such a file ever holds "
                                      f"({_size(limit)})")
        with path.open("rb") as fh:
            return fh.read(limit + 1)[:limit]

    def read_json(self, name: str | Path, limit: int = CONFIG_BYTES):
        """The JSON value of the file (any type); one CheckpointFileError for every way it can be bad."""
        path = self.root / name
        return parse_json(self.read_bytes(name, limit), path)

    def read_yaml(self, name: str | Path, limit: int = CONFIG_BYTES):
        path = self.root / name
        return parse_yaml(self.read_bytes(name, limit), path)


def parse_json(data: bytes, path: str | Path):
    nodes = data.count(b"{") + data.count(b"[") + data.count(b",")
    if nodes > JSON_NODES:
        raise CheckpointFileError(path, f"holds about {nodes:,} JSON values, more than any configuration or "
                                  f"tokenizer ({JSON_NODES:,}); parsing it would take gigabytes")
    try:
        return json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointFileError(path, f"is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})",
                                  "restore the file from the run that saved the checkpoint") from e
    except UnicodeDecodeError as e:
        raise CheckpointFileError(path, f"is not UTF-8 text ({e.reason} at byte {e.start})",
                                  "restore the file from the run that saved the checkpoint") from e
    except RecursionError as e:
        raise CheckpointFileError(path, "nests JSON deeper than any configuration does") from e
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise CheckpointFileError(path, f"holds a value JSON cannot read here ({e})") from e


def parse_yaml(data: bytes, path: str | Path):
    """safe_load, after checking that aliases do not expand past YAML_NODES nodes (a 'billion laughs' file) and
    that no alias refers to its own ancestor (local_files.compose_yaml)."""
    import yaml

    try:
        text = data.decode("utf-8")
        compose_yaml(text, max_nodes=YAML_NODES)
        return yaml.safe_load(text)
    except YamlShapeError as e:
        raise CheckpointFileError(path, f"{e} (a configuration never does)" if "expands" in str(e) else str(e)) \
            from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1} column {mark.column + 1})" if mark is not None else ""
        raise CheckpointFileError(path, f"is not valid YAML{where}: {getattr(e, 'problem', None) or e}",
                                  "restore the file from the run that saved the checkpoint") from e
    except UnicodeDecodeError as e:
        raise CheckpointFileError(path, f"is not UTF-8 text ({e.reason} at byte {e.start})") from e
    except RecursionError as e:
        raise CheckpointFileError(path, "nests YAML deeper than any configuration does") from e
