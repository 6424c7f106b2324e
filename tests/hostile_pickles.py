"""A corpus of hostile checkpoint files, assembled opcode by opcode (no pickler involved, so anything can be named).

Every payload, if it ran, would leave a file at `sentinel` (or open a socket / a process): the tests assert each
file is refused with a clear error and that the sentinel never appears. `live_payloads` proves the corpus is
armed: plain `pickle.loads` of those payloads does create the sentinel.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

# ---- a tiny pickle assembler (protocol 4 opcodes) ---------------------------------------------------------------


def _str(s: str) -> bytes:
    raw = s.encode()
    return (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + len(raw).to_bytes(4, "little")) + raw


def _int(n: int) -> bytes:
    return b"J" + n.to_bytes(4, "little", signed=True)


def value(v) -> bytes:
    """Opcodes pushing a plain value: str, int, bool, None, list/tuple of those, or already-assembled bytes."""
    if isinstance(v, bytes):
        return v
    if isinstance(v, bool):
        return b"\x88" if v else b"\x89"
    if v is None:
        return b"N"
    if isinstance(v, int):
        return _int(v)
    if isinstance(v, str):
        return _str(v)
    if isinstance(v, (list, tuple)):
        body = b"(" + b"".join(value(x) for x in v)
        return body + (b"l" if isinstance(v, list) else b"t")
    raise TypeError(type(v))


def ref(module: str, name: str) -> bytes:
    """STACK_GLOBAL: the unpickler's find_class(module, name); dotted names are attribute paths under protocol 4."""
    return _str(module) + _str(name) + b"\x93"


def call(module: str, name: str, *args) -> bytes:
    """module.name(*args) through REDUCE."""
    return ref(module, name) + value(tuple(args)) + b"R"


def call_value(func: bytes, *args) -> bytes:
    """func(*args) where func is itself assembled (e.g. the result of getattr)."""
    return func + value(tuple(args)) + b"R"


def nested(payload: bytes, how: str) -> bytes:
    """The payload buried inside containers, as a real checkpoint's args would hold it."""
    if how == "dict":
        return b"}" + _str("args") + b"}" + _str("lr") + payload + b"s" + b"s"
    if how == "tuple":
        return value(("x", 1)) + payload + b"\x86" + b"\x86"  # ((x, 1), payload) via TUPLE2
    if how == "list":
        return b"]" + b"(" + _str("a") + payload + b"e"  # [a, payload] via APPENDS
    return payload


def pickle_bytes(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


# ---- the payloads ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    name: str
    body: bytes  # opcodes that push one object


def payloads(sentinel: Path) -> list[Payload]:
    s = str(sentinel)
    touch = f"touch {s}"
    write = f"open({s!r}, 'w').close()"
    out = [
        Payload("os.system", call("os", "system", touch)),
        Payload("posix.system", call("posix", "system", touch)),
        Payload("subprocess.Popen", call("subprocess", "Popen", ["touch", s])),
        Payload("builtins.eval", call("builtins", "eval", write)),
        Payload("builtins.exec", call("builtins", "exec", write)),
        Payload("getattr(__import__('os'), 'system')",
                call_value(call_value(ref("builtins", "getattr"), call("builtins", "__import__", "os"), "system"),
                           touch)),
        Payload("io.FileIO", call("io", "FileIO", s, "w")),
        Payload("_io.FileIO", call("_io", "FileIO", s, "w")),
        Payload("TCPStore", call("torch.distributed", "TCPStore", "127.0.0.1", 0, 1, True)),
        Payload("pickle.loads (a second, unchecked unpickling)",
                call("pickle", "loads", b"C" + bytes([len(pickle_bytes(call("os", "system", touch)))])
                     + pickle_bytes(call("os", "system", touch)))),
        # a class of an allowed module that is not itself allowed (the old prefix rule let these through)
        Payload("FileSystemReader", call("torch.distributed.checkpoint.filesystem", "FileSystemReader", s)),
        # the attack reported against the old prefix rule
        Payload("megatron filesystem_async -> psutil.subprocess.Popen",
                call("megatron.core.dist_checkpointing.strategies.filesystem_async", "psutil.subprocess.Popen",
                     ["touch", s])),
    ]
    # attribute chains through every module a torch_dist index or a torch checkpoint may legitimately name
    allowed_modules = ["torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                       "torch.serialization", "torch", "pathlib", "collections", "builtins", "argparse", "types",
                       "numpy", "numpy.core.multiarray", "megatron.core.transformer.enums", "_codecs"]
    for module in allowed_modules:
        for chain in ("os.system", "subprocess.Popen", "sys.modules"):
            args = (["touch", s],) if chain == "subprocess.Popen" else (touch,)
            out.append(Payload(f"{module} -> {chain}", call(module, chain, *args)))
    return out


def live_payloads(sentinel: Path) -> list[Payload]:
    """Payloads that plain pickle.loads runs here (the corpus is armed, not inert)."""
    names = {"os.system", "builtins.eval", "io.FileIO", "torch.distributed.checkpoint.filesystem -> os.system"}
    return [p for p in payloads(sentinel) if p.name in names]


# ---- files that carry them -----------------------------------------------------------------------------------------


def torch_zip(data_pkl: bytes) -> bytes:
    """A torch.save-format zip archive whose data.pkl is `data_pkl` (what torch.load unpickles)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", data_pkl)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


def checkpoint_pickle(payload: Payload, how: str) -> bytes:
    """A checkpoint-shaped dict {"model": {}, "args": <payload nested `how`>, "iteration": 5}."""
    body = (b"}" + b"(" + _str("model") + b"}" + _str("args") + nested(payload.body, how)
            + _str("iteration") + _int(5) + b"u")
    return pickle_bytes(body)


def metadata_pickle(payload: Payload, how: str) -> bytes:
    """A torch_dist `.metadata`: a real Metadata class called with the payload inside its arguments."""
    inner = nested(payload.body, how)
    return pickle_bytes(ref("torch.distributed.checkpoint.metadata", "Metadata") + b"(" + b"}" + _str("w")
                        + inner + b"s" + b"t" + b"R")
