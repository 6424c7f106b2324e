"""The one rule for every file nano_eval reads or writes outside a checkpoint.

Output folders, a sweep's state (`jobs/`, claims, settings, earlier results), `--data-dir`, task files and the
training hook's folder are shared with other users on a cluster, so they are untrusted input too (a checkpoint's
own files go through `checkpoints/untrusted.py`). The rule, for every such file:

- **Nothing is followed below a root.** A root is the folder the user named (`--output-dir`, `--data-dir`, the
  hook's `output_dir`); the user's own path up to it may hold symlinks, nothing below it may: `real_dir` refuses a
  symlinked or non-folder component, so `<out>/details -> /elsewhere` is refused instead of written into or emptied.
- **Only regular files are opened**, with `O_NOFOLLOW | O_NONBLOCK` and checked with `fstat` on the open descriptor
  (no race between the check and the read): a FIFO, socket or device never blocks a read, a symlink never leads
  elsewhere.
- **Sizes are bounded before reading** (`read_bytes(..., limit)`), JSON is parsed with its depth and type checked,
  YAML is composed with its expanded size and nesting bounded before any parser builds it (`compose_yaml`).
- **Nothing read is executed or unpickled.** State is plain JSON, validated by whoever reads it.
- **Writes are atomic** (`atomic_write_bytes`: a temporary file in the real target folder, then a rename that
  replaces the name, never what a symlink points at); **removals** (`remove_file`) unlink names of regular files or
  links and refuse folders and special files.
- **Names are printed safely**: `printable` escapes control characters, so a folder named with terminal escapes or
  a newline and a forged `nano_eval: error:` line prints as one visible line.

Errors are `LocalFileError`: `<path>: <what>. Fix: <what to do>.` on one line, exit code 2.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from nano_eval.errors import NanoEvalError

STATE_BYTES = 16 << 20  # results.json, sweep settings, jobs/running.json, ... (a results.json is ~10-100 KB)
TEXT_BYTES = 64 << 20  # task-spec files and other small text inputs


class LocalFileError(NanoEvalError):
    """A file or folder around the evaluation that cannot be used safely: `<path>: <what>. Fix: <fix>.` on one
    line, exit code 2."""

    def __init__(self, path: str | Path, what: str, fix: str):
        what = " ".join(str(what).split())
        super().__init__(f"{printable(str(path))}: {printable(what)}. Fix: {fix}.")
        self.path, self.what, self.fix = str(path), what, fix

    def __reduce__(self):  # passed between ranks by pickling
        return type(self), (self.path, self.what, self.fix)


def single_line(text: str) -> str:
    """`text` as one line for a message: our own line breaks (a list of places tried, an indented detail) become
    ' | ', every other control character is escaped by `printable`, so no message prints a second line."""
    lines = [line.strip() for line in str(text).replace("\r\n", "\n").split("\n")]
    return printable(" | ".join(line for line in lines if line))


def printable(text: str) -> str:
    """`text` with every control character (C0, DEL, C1, and Unicode line/paragraph separators) written as an
    escape: `\\x1b[31m` prints as the six characters, a newline as `\\n`; printable text is unchanged."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or ch == " ":
            out.append(ch)
        elif ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif ord(ch) < 0x100:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(f"\\u{ord(ch):04x}")
    return "".join(out)


def kind_of(mode: int) -> str:
    """'FIFO', 'socket', 'folder', 'symlink', ... for an `st_mode`."""
    for test, name in ((stat.S_ISREG, "regular file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


def _below(root: Path, path: Path) -> list[Path]:
    """The components of `path` strictly below `root`, outermost first; `path` must be `root` or under it."""
    try:
        rel = path.relative_to(root)
    except ValueError:
        raise LocalFileError(path, f"is not inside {root}", "keep the file inside its folder") from None
    if ".." in rel.parts:
        raise LocalFileError(path, f"leaves {root} through '..'", "name a path inside the folder")
    parts, current = [], root
    for part in rel.parts:
        current = current / part
        parts.append(current)
    return parts


def real_dir(path: str | Path, *, root: str | Path | None = None, create: bool = False,
             fix: str = "remove or move what is in the way, or choose another folder") -> Path:
    """`path` as a real folder: `root` (default: `path` itself) may be reached through symlinks the user chose;
    every component below it must be a folder, not a symlink or a file. Missing components are made when `create`
    (one at a time, so a symlink planted meanwhile is found), else `path` is returned as it is (callers check
    existence). Raises LocalFileError naming the offending component."""
    path = Path(path)
    root = Path(root) if root is not None else path
    parts = _below(root, path) if path != root else []
    if create and not os.path.isdir(root):
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise LocalFileError(root, f"cannot be created ({e.strerror or e})", fix) from None
    for part in parts:
        try:
            st = os.lstat(part)
        except FileNotFoundError:
            if not create:
                return path
            try:
                os.mkdir(part)
            except FileExistsError:
                pass
            except OSError as e:
                raise LocalFileError(part, f"cannot be created ({e.strerror or e})", fix) from None
            st = os.lstat(part)
        if not stat.S_ISDIR(st.st_mode):
            raise LocalFileError(part, f"is a {kind_of(st.st_mode)}, not a folder" + (
                f" (it points to {printable(os.path.realpath(part))})" if stat.S_ISLNK(st.st_mode) else ""), fix)
    return path


def resolve_inside(path: str | Path, root: str | Path,
                   fix: str = "replace the link by the file or folder itself, or move its target inside") -> Path:
    """The real path of `path`, which must stay inside the real `root` once every symlink is resolved: a link below
    a root that points elsewhere inside it is followed (a mirror may share one copy between two names), one that
    leads out is refused (LocalFileError naming the link and where it leads). A missing `path` resolves as far as it
    exists; the caller checks existence."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and os.path.commonpath([real_root, real]) != real_root:
        raise LocalFileError(path, f"leads outside {real_root} (to {real})", fix)
    return Path(real)


def plain_name(name: object) -> bool:
    """`name` is one file name: a non-empty string without a path separator, NUL or control character, and
    neither '.' nor '..' (what a file listing written by a tool may name without leaving its folder)."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and name.isprintable())


def open_regular(path: str | Path, *, root: str | Path | None = None) -> int:
    """A read-only descriptor of the regular file `path` (the caller closes it). The last component is opened with
    O_NOFOLLOW | O_NONBLOCK (a symlink fails, a FIFO does not block) and checked with fstat; folders between `root`
    and the file are checked by `real_dir`. FileNotFoundError passes through (a missing file is the caller's
    business); everything else is a LocalFileError."""
    path = Path(path)
    if root is not None:
        real_dir(path.parent, root=root)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except NotADirectoryError:  # a file where a folder of the path would be: nothing there either
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path)) from None
    except OSError as e:
        try:
            st = os.lstat(path)
            what = f"is a {kind_of(st.st_mode)}, not a regular file"
        except OSError:
            what = f"cannot be read ({e.strerror or e})"
        raise LocalFileError(path, what, "remove it, or put the file nano_eval wrote there back") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise LocalFileError(path, f"is a {kind_of(st.st_mode)}, not a regular file (reading it could hang)",
                             "remove it, or put the file nano_eval wrote there back")
    return fd


def read_bytes(path: str | Path, limit: int, *, root: str | Path | None = None) -> bytes:
    """The bytes of the regular file `path`, refused (LocalFileError) when larger than `limit`."""
    fd = open_regular(path, root=root)
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fd).st_size
        if size > limit:
            raise LocalFileError(path, f"is {size} bytes, more than nano_eval ever writes or reads there ({limit})",
                                 "remove it, or put the file nano_eval wrote there back")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise LocalFileError(path, f"holds more than {limit} bytes", "remove it")
    return data


def read_text(path: str | Path, limit: int = TEXT_BYTES, *, root: str | Path | None = None) -> str:
    """The UTF-8 text of the regular file `path` (at most `limit` bytes)."""
    data = read_bytes(path, limit, root=root)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LocalFileError(path, f"is not UTF-8 text ({e.reason} at byte {e.start})",
                             "save the file as UTF-8") from None


def read_json(path: str | Path, limit: int = STATE_BYTES, *, root: str | Path | None = None,
              expect: type = dict) -> Any:
    """The JSON value of the regular file `path`, which must be of type `expect` (default: an object)."""
    text = read_text(path, limit, root=root)
    fix = "remove it (nano_eval writes it anew), or put the file nano_eval wrote there back"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise LocalFileError(path, f"is not valid JSON (line {e.lineno} column {e.colno}: {e.msg})", fix) from None
    except RecursionError:
        raise LocalFileError(path, "nests JSON deeper than nano_eval ever writes", fix) from None
    except ValueError as e:
        raise LocalFileError(path, f"holds a value JSON cannot read here ({e})", fix) from None
    if expect is not None and not isinstance(value, expect):
        raise LocalFileError(path, f"holds a JSON {type(value).__name__}, not the {expect.__name__} nano_eval "
                             "writes there", fix)
    return value


def entry_kind(path: str | Path) -> str | None:
    """What is at `path` without following a final symlink: None (nothing), 'regular file', 'folder', 'symlink',
    'FIFO', ..."""
    try:
        return kind_of(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):  # nothing there, or a file where a folder of the path would be
        return None


def remove_file(path: str | Path, *, root: str | Path | None = None) -> None:
    """Remove the name `path` if it is a regular file or a symlink (the link only, never its target); nothing if
    it does not exist; a folder or special file in its place is a LocalFileError (nano_eval never made it)."""
    path = Path(path)
    if root is not None:
        real_dir(path.parent, root=root)
    kind = entry_kind(path)
    if kind is None:
        return
    if kind not in ("regular file", "symlink"):
        raise LocalFileError(path, f"is a {kind} where nano_eval keeps a file", "remove or move it")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def check_file_slot(path: str | Path, *, root: str | Path | None = None) -> None:
    """`path` may be written by `atomic_write_bytes`: its folders below `root` are real (or missing), and nothing
    but a regular file or a symlink (replaced, not followed) is in its place."""
    path = Path(path)
    real_dir(path.parent, root=root if root is not None else path.parent)
    kind = entry_kind(path)
    if kind not in (None, "regular file", "symlink"):
        raise LocalFileError(path, f"is a {kind} where nano_eval writes a file", "remove or move it")


def atomic_write_bytes(path: str | Path, data: bytes, *, root: str | Path | None = None) -> None:
    """Write `data` to `path` atomically: a uniquely named temporary file in the (real) folder, fsynced, given the
    permissions the umask allows, then renamed over `path` (a symlink there is replaced, not followed). Folders
    below `root` (default: the file's folder) are made as needed and must not be symlinks."""
    path = Path(path)
    tmp = write_temporary(path, data, root=root)
    move_into_place(tmp, path)


def write_temporary(path: str | Path, data: bytes, *, root: str | Path | None = None) -> Path:
    """The first half of `atomic_write_bytes`: `data` in a new, uniquely named, fsynced temporary file next to
    `path` (`.<name>.<random>.tmp`, given the permissions the umask allows), after checking that `path` can be
    replaced (`check_file_slot`). The caller moves it into place (`move_into_place`) or removes it. Several files
    prepared this way can replace their names together, after every write has succeeded."""
    path = Path(path)
    check_file_slot(path, root=root)
    real_dir(path.parent, root=root if root is not None else path.parent, create=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def move_into_place(tmp: str | Path, path: str | Path) -> None:
    """Rename the temporary file `tmp` (from `write_temporary`) over the name `path` (a symlink there is replaced,
    not followed); `tmp` is removed if that fails."""
    path = Path(path)
    try:
        os.replace(tmp, path)
    except IsADirectoryError:
        Path(tmp).unlink(missing_ok=True)
        raise LocalFileError(path, "is a folder where nano_eval writes a file", "remove or move it") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), else set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def append_text(path: str | Path, text: str, *, root: str | Path | None = None) -> None:
    """Append `text` to the regular file `path` (created if missing) in one write, then fsync; opened with
    O_NOFOLLOW | O_NONBLOCK and checked with fstat: a FIFO or symlink planted there is refused instead of blocking
    or writing elsewhere."""
    path = Path(path)
    real_dir(path.parent, root=root if root is not None else path.parent, create=True)
    flags = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        kind = entry_kind(path)
        what = f"is a {kind}, not a regular file" if kind not in (None, "regular file") else \
            f"cannot be written ({e.strerror or e})"
        raise LocalFileError(path, what, "remove it, or choose another folder") from None
    with os.fdopen(fd, "ab") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LocalFileError(path, f"is a {kind_of(os.fstat(fd).st_mode)}, not a regular file",
                                 "remove it, or choose another folder")
        fh.write(text.encode("utf-8"))
        fh.flush()
        os.fsync(fd)


def lock_file(path: str | Path, *, root: str | Path | None = None, blocking: bool = False) -> int | None:
    """An exclusive OS lock (flock) on the regular file `path` (created if missing; opened with O_NOFOLLOW |
    O_NONBLOCK and checked with fstat, so a symlink planted there is neither followed nor truncated): the open
    descriptor, which holds the lock until closed (the kernel releases it when the process dies), or None when
    another holder has it and not `blocking`."""
    import fcntl

    path = Path(path)
    real_dir(path.parent, root=root if root is not None else path.parent, create=True)
    flags = (os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    fix = "remove it (nano_eval makes it anew), or choose another folder"
    try:
        fd = os.open(path, flags, 0o666 & ~current_umask())
    except OSError as e:
        kind = entry_kind(path)
        raise LocalFileError(path, f"is a {kind}, not a regular file" if kind not in (None, "regular file")
                             else f"cannot be opened ({e.strerror or e})", fix) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LocalFileError(path, f"is a {kind_of(os.fstat(fd).st_mode)}, not a regular file", fix)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise
    return fd


FINGERPRINT_FILES = 20_000  # files a folder fingerprint reads at most
FINGERPRINT_BYTES = 256 << 20  # bytes it reads at most, all files together
FINGERPRINT_SKIPPED = ("__pycache__", ".ipynb_checkpoints", ".git")  # folders of caches and tools, never read


def folder_fingerprint(root: str | Path, wanted, *, fix: str) -> str:
    """A hex digest of the relative names and contents of the files under `root` whose name `wanted(name)` accepts:
    it changes when such a file is added, removed, renamed or edited, and with nothing else. Read by this module's
    rule: regular files only (a FIFO is refused, never read), each at most TEXT_BYTES, at most FINGERPRINT_FILES
    files and FINGERPRINT_BYTES in all; a symlink below `root` (file or folder) counts as its target while that
    stays inside `root` (a folder link is recorded by name and target, its files are read where they lie) and is
    refused when it leads out. Errors are LocalFileError naming the file, with `fix`."""
    import hashlib

    root = Path(os.path.realpath(Path(root).expanduser()))
    entries, total = [], 0
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in FINGERPRINT_SKIPPED)
        for name in sorted(dirs):
            path = Path(folder) / name
            if os.path.islink(path):
                target = resolve_inside(path, root, fix)
                entries.append(f"{path.relative_to(root)} -> {target.relative_to(root)}")
        for name in sorted(files):
            if not wanted(name):
                continue
            path = Path(folder) / name
            real = resolve_inside(path, root, fix) if os.path.islink(path) else path
            if len(entries) >= FINGERPRINT_FILES:
                raise LocalFileError(root, f"holds more than {FINGERPRINT_FILES} files to fingerprint", fix)
            try:
                data = read_bytes(real, TEXT_BYTES, root=root)
            except FileNotFoundError:  # a dangling link, or removed meanwhile
                entries.append(f"{path.relative_to(root)} missing")
                continue
            except LocalFileError as e:
                raise LocalFileError(e.path, e.what, fix) from None
            total += len(data)
            if total > FINGERPRINT_BYTES:
                raise LocalFileError(root, f"holds more than {FINGERPRINT_BYTES} bytes of files to fingerprint", fix)
            entries.append(f"{path.relative_to(root)} {hashlib.sha256(data).hexdigest()}")
    return hashlib.sha256("\n".join(sorted(entries)).encode("utf-8", "surrogateescape")).hexdigest()[:16]


class YamlShapeError(ValueError):
    """A YAML document past `compose_yaml`'s bounds; the message says how (one line, without the file's name)."""


def compose_yaml(text: str, *, max_nodes: int, max_depth: int | None = None):
    """The YAML document `text` as PyYAML's node graph (None when empty), composed by the pure-Python parser (libyaml's
    composer recurses in C: 100,000 `[` crash the process), and checked before anything builds it: at most
    `max_nodes` nodes once every alias is expanded (a "billion laughs" file is refused at once, its aliases counted
    without expanding them), nesting at most `max_depth` deep counting through aliases (None: only the parser's
    own limit), no alias containing itself. Tags are not interpreted (a `!function` node is a node). Raises
    YamlShapeError past a bound, yaml.YAMLError for text that is no YAML."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except RecursionError:
        raise YamlShapeError("nests YAML deeper than the parser can follow") from None
    if node is not None:
        _yaml_extent(node, max_nodes, max_depth)
    return node


def _yaml_extent(root, max_nodes: int, max_depth: int | None) -> None:
    """Nodes and depth of the document with every alias expanded, computed without expanding (a shared node is
    counted once per reference); iterative, so depth costs no recursion."""
    sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (expanded nodes, depth)
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = [sizes[id(c)] for c in yaml_children(node)]
            total = 1 + sum(n for n, _ in children)
            depth = 1 + max((d for _, d in children), default=0)
            if total > max_nodes:
                raise YamlShapeError(f"expands to more than {max_nodes:,} YAML nodes through its aliases")
            if max_depth is not None and depth > max_depth:
                raise YamlShapeError(f"nests YAML more than {max_depth} levels deep")
            sizes[key] = (total, depth)
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise YamlShapeError("holds a YAML alias that contains itself")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in yaml_children(node) if id(c) not in sizes)


def yaml_children(node) -> list:
    """The nodes directly inside a composed YAML node (a mapping's keys and values, a sequence's items)."""
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []
