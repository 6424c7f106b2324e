"""Find the checkpoints of a training run directory, tell finished ones from ones still being written, select some.

Layouts (one run directory holds one kind):
  nanotron   RUN/<step>/{config.yaml, model/, checkpoint_metadata.json}  + RUN/latest.txt (last complete step)
  megatron   RUN/iter_0000100/...                                       + RUN/latest_checkpointed_iteration.txt
  hf         RUN/checkpoint-500/, RUN/step_100/, RUN/step-100/, or any folder with config.json and a number in its name
  torchtitan RUN/checkpoint/step-100/{.metadata, __0_0.distcp, ...}   (RUN: torchtitan's dump_folder; or pass its
             checkpoint/ folder itself). A step-N folder is torchtitan's when it holds DCP files or the hook's
             nano_eval_torchtitan.json, or lies in a folder named `checkpoint`, and has no config.json

A checkpoint is complete when its trainer's marker file says so (nanotron latest.txt / checkpoint_metadata.json,
Megatron's tracker file, torchtitan's DCP `.metadata`, which torch.distributed.checkpoint renames into place after
every rank's data is written) or, for hf folders, when config.json and every weight file are there (the index lists its
shards; a safetensors file is as long as its header says) and no temporary file is left. Marker-less checkpoints
must also look the same (sizes, mtimes) on two looks at least `settle_s` apart: `Settler` keeps those looks.

A run directory is a listing other users may write into, so it is read by the rule of nano_eval.local_files: a
checkpoint folder that is a symlink leading outside the run directory is skipped with a warning (pass it as
--checkpoint to evaluate it anyway), a file of a checkpoint (a tracker, a safetensors header) is read only when it
is a regular file inside its folder (a symlink out or a FIFO makes the checkpoint unfinished, never a read or a
hang), and messages print names and sizes, never a file's bytes.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nano_eval.checkpoints.files import read_safetensors_header
from nano_eval.checkpoints.untrusted import CONFIG_BYTES, CheckpointFileError, parse_json, parse_yaml
from nano_eval.local_files import LocalFileError, open_regular, printable, read_bytes, resolve_inside

NANOTRON_LATEST = "latest.txt"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
HF_NAME = re.compile(r"^(?:checkpoint|step|global_step|iter|ckpt)[-_]?(\d+)$")
MEGATRON_NAME = re.compile(r"^iter_(\d+)$")
TORCHTITAN_NAME = re.compile(r"^step-(\d+)$")
TORCHTITAN_FOLDER = "checkpoint"  # torchtitan's <dump_folder>/checkpoint/ (its checkpoint.folder default)
# the names nano_eval.checkpoints.megatron_dist.INDEX / torchtitan.MODEL_FILE (not imported: they pull in torch)
DCP_INDEX = ".metadata"
TORCHTITAN_MODEL_FILE = "nano_eval_torchtitan.json"
TEMP_MARKERS = (".tmp", ".temp", ".partial", ".incomplete", ".lock", ".part")
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    kind: str  # "nanotron" | "megatron" | "hf" | "torchtitan"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def shown(self) -> str:
        """The folder's name for a message: control characters escaped (a name is anyone's text)."""
        return printable(self.path.name)

    @property
    def shown_path(self) -> str:
        return printable(str(self.path))


def is_temporary(name: str) -> bool:
    """Names that trainers and copy tools use while a file or folder is still being written."""
    lower = name.lower()
    return lower.startswith("tmp") or lower.endswith(TEMP_MARKERS) or ".tmp" in lower


def _read_small(path: Path, limit: int = CONFIG_BYTES, root: Path | None = None) -> bytes | None:
    """The bytes of `path` if it is a regular file of at most `limit` bytes inside `root` (default: its folder;
    symlinks followed only while they stay inside), else None: for looking at a run folder (trackers, trainer state)
    where a missing or odd file only means "not there yet". Opened with O_NOFOLLOW | O_NONBLOCK: never blocks."""
    try:
        return read_bytes(resolve_inside(path, path.parent if root is None else root), limit)
    except (LocalFileError, OSError):
        return None


def _read_int(path: Path) -> int | None:
    data = _read_small(path, 64)
    try:
        return None if data is None else int(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None  # missing, or "release" in a Megatron tracker


def _read_json(path: Path):
    """The JSON value of a file of the run folder, or None when it is missing, odd or unreadable."""
    data = _read_small(path)
    try:
        return None if data is None else parse_json(data, path)
    except CheckpointFileError:
        return None


def classify(path: Path, run_dir: Path | None = None) -> Checkpoint | None:
    """The checkpoint this folder is (complete or not), or None when it is not one."""
    if not path.is_dir() or path.name.startswith(".") or is_temporary(path.name):
        return None
    name = path.name
    if m := MEGATRON_NAME.match(name):
        return Checkpoint(path, int(m.group(1)), "megatron")
    nanotron_run = run_dir is not None and (run_dir / NANOTRON_LATEST).exists()
    if name.isdigit() and ((path / "config.yaml").exists() or (path / "model").is_dir() or nanotron_run):
        return Checkpoint(path, int(name), "nanotron")
    if (m := TORCHTITAN_NAME.match(name)) and not (path / "config.json").exists() and (
            path.parent.name == TORCHTITAN_FOLDER or _holds_dcp(path)):
        return Checkpoint(path, int(m.group(1)), "torchtitan")
    if m := HF_NAME.match(name):
        return Checkpoint(path, int(m.group(1)), "hf")
    numbers = re.findall(r"\d+", name)
    if numbers and (path / "config.json").exists():
        return Checkpoint(path, int(numbers[-1]), "hf")
    return None


def _holds_dcp(path: Path) -> bool:
    """A torch.distributed.checkpoint folder, or one being written (its index or data files), or one the
    torchtitan hook marked."""
    return (path / DCP_INDEX).exists() or (path / TORCHTITAN_MODEL_FILE).exists() or any(path.glob("*.distcp"))


def is_checkpoint_dir(path: str | Path) -> bool:
    """True when `path` is itself one checkpoint (not a run directory holding several)."""
    p = Path(path)
    return (p / "config.json").exists() or ((p / "config.yaml").exists() and (p / "model").is_dir()) or bool(
        MEGATRON_NAME.match(p.name)) or bool(TORCHTITAN_NAME.match(p.name) and _holds_dcp(p))


def listing(run_dir: str | Path) -> Path:
    """The folder whose subfolders are the run's checkpoints: `run_dir`, or for a torchtitan dump folder (holding
    `checkpoint/step-N/`, no checkpoint of its own) its `checkpoint/` folder, when that lies inside `run_dir`."""
    run = Path(run_dir)
    folder = run / TORCHTITAN_FOLDER
    if not folder.is_dir() or is_checkpoint_dir(run) or classify(folder, run) is not None:
        return run
    try:
        resolve_inside(folder, run)
    except LocalFileError:
        return run
    return folder if any(TORCHTITAN_NAME.match(p.name) for p in folder.iterdir()) else run


_warned: set[Path] = set()


def _inside_run(path: Path, run: Path) -> bool:
    """False (with one warning per path and process) when `path` is a symlink leading outside the run directory:
    a run directory is a listing, and what it links to elsewhere is not this run's to evaluate."""
    if not path.is_symlink():
        return True
    try:
        resolve_inside(path, run)
        return True
    except LocalFileError:
        if path not in _warned and classify(path, run) is not None:
            _warned.add(path)
            print(f"nano_eval: warning: skipping {printable(str(path))}: a symlink leading outside the run directory. "
                  "Fix: pass it as --checkpoint to evaluate it, or copy it into the run directory.",
                  file=sys.stderr, flush=True)
        return False


def discover(run_dir: str | Path) -> list[Checkpoint]:
    """Every checkpoint folder directly under `run_dir` (a torchtitan dump folder: under its `checkpoint/`),
    finished or not, in step order (symlinked folders leading outside `run_dir` are skipped with a warning)."""
    run = Path(run_dir)
    folder = listing(run) if run.is_dir() else run
    found = [c for c in (classify(p, folder) for p in sorted(folder.iterdir()) if _inside_run(p, run))
             if c is not None] if run.is_dir() else []
    steps: dict[int, Checkpoint] = {}
    for c in found:
        if c.step in steps:  # two names for one step (checkpoint-5 and step_5): keep the first, by name
            continue
        steps[c.step] = c
    return sorted(steps.values(), key=lambda c: c.step)


def select(ckpts: list[Checkpoint], *, every: int | None = None, min_step: int | None = None,
           max_step: int | None = None, last: int | None = None) -> list[Checkpoint]:
    """Step range first, then every k-th step (step % k == 0), then the last N; result in step order."""
    out = [c for c in ckpts if (min_step is None or c.step >= min_step) and (max_step is None or c.step <= max_step)]
    if every:
        out = [c for c in out if c.step % every == 0]
    if last is not None:
        out = out[-last:] if last > 0 else []
    return out


def missing_parts(ckpt: Checkpoint, run_dir: Path) -> str | None:
    """Why `ckpt` is not finished yet (None when it is, as far as files can tell)."""
    temp = [p.name for p in ckpt.path.rglob("*")
            if is_temporary(p.name) and not any(part.startswith(".") for part in p.relative_to(ckpt.path).parts[:-1])]
    if temp:
        return f"temporary files {sorted(temp)[:3]} are still there"
    if ckpt.kind == "megatron":
        latest = _read_int(run_dir / MEGATRON_TRACKER)
        return None if latest is not None and ckpt.step <= latest else f"{MEGATRON_TRACKER} does not reach it yet"
    if ckpt.kind == "nanotron":
        return _nanotron_missing(ckpt, run_dir)
    if ckpt.kind == "torchtitan":
        return None if _dcp_index_written(ckpt.path) else (
            f"its {DCP_INDEX} is not written yet (torch.distributed.checkpoint writes it once every rank's data is)")
    return _hf_missing(ckpt.path)


def _dcp_index_written(path: Path) -> bool:
    """The DCP index of the folder is there as a regular file inside it (not read: the loader checks it whole)."""
    try:
        return stat.S_ISREG(os.stat(resolve_inside(path / DCP_INDEX, path)).st_mode)
    except (LocalFileError, OSError):
        return False


def has_marker(ckpt: Checkpoint, run_dir: Path) -> bool:
    """True when the trainer itself declared the checkpoint finished (a tracker file that reaches its step;
    torchtitan's: the DCP index, written last)."""
    if ckpt.kind == "torchtitan":
        return _dcp_index_written(ckpt.path)
    tracker = {"nanotron": NANOTRON_LATEST, "megatron": MEGATRON_TRACKER}.get(ckpt.kind)
    latest = _read_int(run_dir / tracker) if tracker else None
    return latest is not None and ckpt.step <= latest


def _nanotron_missing(ckpt: Checkpoint, run_dir: Path) -> str | None:
    if not (ckpt.path / "config.yaml").exists() or not (ckpt.path / "model").is_dir():
        return "config.yaml or model/ is missing"
    if has_marker(ckpt, run_dir) or (ckpt.path / "checkpoint_metadata.json").exists():
        return _truncated_safetensors(ckpt.path / "model", ckpt.path)
    return f"neither {NANOTRON_LATEST} reaches step {ckpt.step} nor checkpoint_metadata.json exists"


def _hf_missing(path: Path) -> str | None:
    if not (path / "config.json").exists():
        return "config.json is missing"
    for index in HF_INDEXES:
        if (path / index).exists():
            index_doc = _read_json(path / index)
            weight_map = index_doc.get("weight_map") if isinstance(index_doc, dict) else None
            if not isinstance(weight_map, dict):
                return f"{index} is unreadable"
            shards = {str(s) for s in weight_map.values()}
            absent = sorted(s for s in shards if not (path / s).exists())
            if absent:
                return f"shards {absent[:3]} listed in {index} are missing"
            return _truncated_safetensors(path)
    if not any((path / w).exists() for w in HF_WEIGHTS):
        return f"no weights ({', '.join(HF_WEIGHTS + HF_INDEXES)})"
    return _truncated_safetensors(path)


def _truncated_safetensors(folder: Path, checkpoint: Path | None = None) -> str | None:
    """The first safetensors file under `folder` whose size disagrees with its header (still being written?), or
    that is not a regular file inside its `checkpoint` folder (default: `folder`; a FIFO would hang the read, a link
    out would be read)."""
    for f in sorted(folder.rglob("*.safetensors")):
        problem = safetensors_problem(f, folder if checkpoint is None else checkpoint)
        if problem is not None:
            return problem
    return None


def safetensors_problem(path: Path, folder: Path) -> str | None:
    """Why the safetensors file `path` of the checkpoint folder `folder` is not finished, naming the file and its
    size only (the header's own numbers could be another file's bytes)."""
    name = printable(str(path.relative_to(folder)))
    try:
        fd = open_regular(resolve_inside(path, folder))
    except LocalFileError as e:
        return f"{name} {e.what}"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror})"
    with os.fdopen(fd, "rb") as fh:
        size = os.fstat(fd).st_size
        try:
            read_safetensors_header(fh, size, path)
        except CheckpointFileError:
            return f"{name} is {size} bytes but its header says otherwise (still being written?)"
        except OSError as e:
            return f"{name} cannot be read ({e.strerror})"
    return None


def snapshot(path: Path) -> tuple:
    """(relative path, size, mtime) of every file: equal on two looks means nothing was written in between."""
    return tuple(sorted((str(p.relative_to(path)), st.st_mode, st.st_size, st.st_mtime_ns)
                        for p in path.rglob("*") if (st := _lstat(p)) is not None and not stat.S_ISDIR(st.st_mode)))


def _lstat(path: Path):
    try:
        return path.lstat()
    except OSError:  # removed meanwhile
        return None


class Settler:
    """Remembers when each checkpoint last changed; `settled` once it has looked the same for `settle_s` seconds."""

    def __init__(self, settle_s: float):
        self.settle_s = settle_s
        self._seen: dict[Path, tuple[tuple, float]] = {}

    def settled(self, ckpt: Checkpoint, now: float | None = None) -> bool:
        if self.settle_s <= 0:
            return True
        now = time.monotonic() if now is None else now
        snap = snapshot(ckpt.path)
        previous = self._seen.get(ckpt.path)
        if previous is None or previous[0] != snap:
            self._seen[ckpt.path] = (snap, now)
            return False
        return now - previous[1] >= self.settle_s

    def wait_s(self, ckpt: Checkpoint, now: float | None = None) -> float:
        """Seconds left before `ckpt` can count as settled if it does not change again."""
        previous = self._seen.get(ckpt.path)
        now = time.monotonic() if now is None else now
        return self.settle_s if previous is None else max(0.0, self.settle_s - (now - previous[1]))


def ready(ckpt: Checkpoint, run_dir: Path, settler: Settler) -> tuple[bool, str | None]:
    """(finished and safe to read, why not). Marker-declared checkpoints skip the settling wait."""
    why = missing_parts(ckpt, run_dir)
    if why is not None:
        return False, why
    if has_marker(ckpt, run_dir) or settler.settled(ckpt):
        return True, None
    return False, f"still changing or seen for less than {settler.settle_s:g}s"


def consumed_tokens(ckpt: Checkpoint) -> int | None:
    """Tokens the trainer had consumed at this checkpoint, when its files say (nanotron metadata, HF trainer state,
    the torchtitan hook's nano_eval_torchtitan.json)."""
    try:
        if ckpt.kind == "torchtitan":
            seen = (_read_json(ckpt.path / TORCHTITAN_MODEL_FILE) or {}).get("consumed_tokens")
            return seen if type(seen) is int and seen >= 0 else None
        if ckpt.kind == "nanotron" and (ckpt.path / "checkpoint_metadata.json").exists():
            metas = (_read_json(ckpt.path / "checkpoint_metadata.json") or {}).get("metas", {})
            if metas.get("consumed_tokens_total"):
                return int(metas["consumed_tokens_total"])
            samples = metas.get("consumed_train_samples")
            seq = _nanotron_sequence_length(ckpt.path)
            return int(samples) * seq if samples is not None and seq else None
        if (ckpt.path / "trainer_state.json").exists():
            seen = (_read_json(ckpt.path / "trainer_state.json") or {}).get("num_input_tokens_seen")
            return int(seen) if seen else None
    except (ValueError, TypeError, AttributeError, OverflowError):
        return None
    return None


def _nanotron_sequence_length(path: Path) -> int | None:
    data = _read_small(path / "config.yaml")
    try:
        config = parse_yaml(data, path / "config.yaml") if data is not None else None
    except CheckpointFileError:
        return None
    tokens = config.get("tokens") if isinstance(config, dict) else None
    length = tokens.get("sequence_length") if isinstance(tokens, dict) else None
    return length if type(length) is int and length > 0 else None
