"""Fuzz nano_eval's checkpoint loaders with damaged copies of genuine checkpoints (tests/genuine_checkpoints.py).

    python -m tests.checkpoint_fuzz GENUINE_ROOT TOKENIZER_DIR WORK_DIR REPORT.json [--seed S] [--per-kind N]

Runs in its own process, under an address-space limit (RLIMIT_AS: the process's size after imports + 2 GiB) and
a per-case alarm. Every case copies one genuine checkpoint, applies one seeded mutation and calls `load_backend`
(with `max_checkpoint_bytes` = 256 MiB). Mutations: truncation, byte flips (half of them inside the structure: a
zip archive's data.pkl, a safetensors header, a .metadata), number edits in JSON / YAML / safetensors headers
(sizes made 0, negative or huge), pickle opcode edits (an opcode byte replaced, an integer argument made huge).

Each case ends as one of:
  refused    a NanoEvalError of one line (what the command line prints, exit code 2)
  same       loaded, and its logits on a fixed input equal the genuine checkpoint's
  different  loaded with other logits (only a flip inside tensor bytes may do that: the formats have no checksums)
  memory     refused only because an allocation failed (the loader tried to allocate past its limit)  -> defect
  crash      anything else escaped load_backend                                                      -> defect
  timeout    the case did not end within its alarm                                                    -> defect
The report also records whether process-wide state a hostile pickle could mutate (pathlib's and argparse's
classes, signal.Signals members) is unchanged after all cases.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import signal
import struct
import time
import zipfile
from pathlib import Path

from tests.fuzz_case import cap_memory, run_case

CASE_ALARM_S = 20
CAP_BYTES = 256 << 20
MEMORY_WORDS = ("MemoryError", "DefaultCPUAllocator", "can't allocate", "cannot allocate", "out of memory",
                "std::bad_alloc")




# ---- where the structure is ---------------------------------------------------------------------------------------

def structure_span(path: Path) -> tuple[int, int]:
    """(start, end) of the bytes that describe the file's contents rather than hold tensor data."""
    data = path.read_bytes()
    if data[:4] == b"PK\x03\x04":
        try:
            with zipfile.ZipFile(path) as z:
                info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
                start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
                return start, start + info.compress_size
        except (zipfile.BadZipFile, StopIteration):
            return 0, len(data)
    if path.suffix == ".safetensors" and len(data) >= 8:
        return 8, 8 + min(struct.unpack("<Q", data[:8])[0], len(data) - 8)
    if path.suffix == ".distcp":
        return 0, min(len(data), 4096)
    return 0, len(data)  # .metadata, JSON, YAML, text: all structure


def _pickle_positions(data: bytes, start: int, end: int) -> list[tuple[int, str, int]]:
    """(offset of the opcode, opcode name, length of its argument) of every opcode of the pickle at [start, end)."""
    import pickletools

    out = []
    try:
        ops = list(pickletools.genops(data[start:end]))
    except Exception:  # noqa: BLE001 - an already damaged pickle: no opcode positions
        return out
    for i, (op, _arg, pos) in enumerate(ops):
        nxt = ops[i + 1][2] if i + 1 < len(ops) else end - start
        out.append((start + pos, op.name, nxt - pos - 1))
    return out


# ---- mutations ------------------------------------------------------------------------------------------------------

def truncate(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    cut = rng.randrange(0, max(1, len(data)))
    path.write_bytes(data[:cut])
    return f"truncate {path.name} at {cut}/{len(data)}"


def flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if not data:
        return f"flip {path.name} (empty)"
    start, end = structure_span(path) if rng.random() < 0.5 else (0, len(data))
    where = []
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(start, max(start + 1, end)) if end > start else rng.randrange(len(data))
        i = min(i, len(data) - 1)
        data[i] ^= 1 << rng.randrange(8)
        where.append(i)
    path.write_bytes(bytes(data))
    inside = all(start <= i < end for i in where)
    return f"flip {path.name} at {where}" + (" (structure)" if inside else "")


HUGE = ["0", "-1", "2147483648", "1099511627776", "1000000000000000000", "3.5", '"x"']


def edit_number(path: Path, rng: random.Random) -> str:
    """A number in a text file (JSON, YAML, a safetensors header) replaced by 0, -1 or a huge value."""
    data = path.read_bytes()
    start, end = structure_span(path)
    numbers = [m for m in re.finditer(rb"-?\d+", data[start:end])]
    if not numbers:
        return flip(path, rng)
    m = rng.choice(numbers)
    new = rng.choice(HUGE).encode()
    if path.suffix == ".safetensors":  # keep the header length: pad with spaces, or fall back to a flip
        width = m.end() - m.start()
        if len(new) > width:
            new = new[:width] if new[:1] != b"-" else b"-1"[:width]
        new = new.ljust(width)
    path.write_bytes(data[: start + m.start()] + new + data[start + m.end():])
    return f"edit number {m.group().decode()!r} -> {new.decode().strip()!r} in {path.name}"


def edit_pickle(path: Path, rng: random.Random) -> str:
    """One opcode of the file's pickle replaced by another, or one integer argument made huge."""
    data = bytearray(path.read_bytes())
    start, end = structure_span(path)
    ops = _pickle_positions(bytes(data), start, end)
    if not ops:
        return flip(path, rng)
    offset, name, arg_len = rng.choice(ops)
    ints = [o for o in ops if o[1] in ("BININT", "BININT1", "BININT2", "LONG1", "BINGET", "LONG_BINGET", "BINPUT")]
    if ints and rng.random() < 0.5:
        offset, name, arg_len = rng.choice(ints)
        data[offset + 1: offset + 1 + arg_len] = bytes([0xFF] * arg_len)
        what = f"{name} argument -> all 0xff"
    else:
        old = data[offset]
        data[offset] = rng.choice(b"().0123BCFGIJKLMNPQRSTUVXabcdeghijlmopqrstu}]\x80\x81\x82\x83\x84\x85\x86\x87"
                                  b"\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x90\x91\x92\x93\x94\x95\x96\x97\x98")
        what = f"{name} ({old:#x}) -> {data[offset]:#x}"
    path.write_bytes(bytes(data))
    return f"edit pickle at {offset} in {path.name}: {what}"


def files_of(kind: str, ckpt: Path) -> list[Path]:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    if kind.startswith("hf"):
        files = [p for p in files if p.name in ("config.json", "model.safetensors", "pytorch_model.bin",
                                                 "tokenizer_config.json")]
    return files


def mutations_for(path: Path) -> list:
    if path.suffix in (".json", ".yaml"):
        return [truncate, flip, edit_number]
    if path.suffix == ".safetensors":
        return [truncate, flip, edit_number]
    if path.suffix in (".pt", ".bin") or path.name == ".metadata":
        return [truncate, flip, edit_pickle]
    return [truncate, flip]


# ---- running cases ------------------------------------------------------------------------------------------------

def logits_of(backend) -> "torch.Tensor":
    import torch

    model = getattr(backend, "model", None)
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]])
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def state_snapshot() -> str:
    """Process-wide state a pickle's BUILD could reach, as text."""
    import argparse as ap
    import pathlib

    classes = (pathlib.PurePath, pathlib.PurePosixPath, pathlib.Path, pathlib.PosixPath, ap.Namespace)
    parts = [f"{c.__qualname__}:{sorted(vars(c))}" for c in classes]
    parts += [f"{s!r}:{s.name}:{s.value}:{sorted(vars(s))}" for s in signal.Signals]
    return "\n".join(parts)


def run(genuine_root: Path, tokenizer_dir: Path, work: Path, seed: int, per_kind: int) -> dict:
    import torch

    from nano_eval.checkpoints.load import LoadOptions, load_backend
    from nano_eval.errors import NanoEvalError
    from tests.genuine_checkpoints import KINDS, paths

    torch.set_num_threads(1)
    genuine = paths(genuine_root)
    options = {kind: LoadOptions(tokenizer=str(tokenizer_dir) if kind in ("legacy", "torch_dist") else None,
                                 max_checkpoint_bytes=CAP_BYTES) for kind in KINDS}  # the others: their own
    reference = {kind: logits_of(load_backend(str(genuine[kind]), options[kind])) for kind in KINDS}
    before = state_snapshot()
    size, uncap = cap_memory(2 << 30)
    rng = random.Random(seed)
    cases = []
    start = time.perf_counter()
    for kind in KINDS:
        # the checkpoint folder to copy: Megatron iteration folders sit in their run dir (the tracker file)
        source = genuine[kind].parent if kind in ("legacy", "torch_dist", "nanotron") else genuine[kind]
        for i in range(per_kind):
            case_root = work / f"{kind}_{i}"
            shutil.copytree(source, case_root, symlinks=True)
            ckpt = case_root / genuine[kind].relative_to(source) if source != genuine[kind] else case_root
            target = rng.choice(files_of(kind, ckpt))
            mutation = rng.choice(mutations_for(target))
            what = mutation(target, rng)
            t0 = time.perf_counter()
            outcome, message = _load(load_backend, NanoEvalError, str(ckpt), options[kind], reference[kind])
            cases.append({"kind": kind, "mutation": what, "outcome": outcome, "message": message[:500],
                          "seconds": round(time.perf_counter() - t0, 3)})
            shutil.rmtree(case_root, ignore_errors=True)
    uncap()
    return {"cases": cases, "seconds": round(time.perf_counter() - start, 1),
            "state_unchanged": state_snapshot() == before, "address_space_gib": round(size / (1 << 30), 2)}


def _load(load_backend, error_type, path: str, options, reference) -> tuple[str, str]:
    """The case's outcome and message, under the case alarm (tests/fuzz_case.py)."""
    return run_case(lambda: _load_once(load_backend, error_type, path, options, reference), CASE_ALARM_S)


def _load_once(load_backend, error_type, path: str, options, reference) -> tuple[str, str]:
    import torch

    try:
        backend = load_backend(path, options)
        got = logits_of(backend)
        same = got.shape == reference.shape and torch.equal(got, reference)
        return ("same" if same else "different"), ""
    except error_type as e:
        text = str(e)
        if any(w in text for w in MEMORY_WORDS):
            return "memory", text
        return ("refused" if "\n" not in text else "crash"), text
    except BaseException as e:  # noqa: BLE001 - the defect the fuzz looks for
        import traceback

        return ("memory" if isinstance(e, MemoryError) else "crash"), "".join(traceback.format_exception(e))[-1500:]


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    p = argparse.ArgumentParser()
    p.add_argument("genuine_root", type=Path)
    p.add_argument("tokenizer_dir", type=Path)
    p.add_argument("work", type=Path)
    p.add_argument("report", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-kind", type=int, default=60)
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    report = run(a.genuine_root, a.tokenizer_dir, a.work, a.seed, a.per_kind)
    a.report.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
