"""Hostile checkpoint files beyond pickled payloads (tests/test_hostile_checkpoints.py): torch_dist indexes that
point bytes entries or paths where they should not, symlinks out of the folder, BUILD on shared objects, files that
would make a loader allocate without bound or hang, and ~20 kinds of damaged files. Each is built from a genuine
checkpoint (tests/genuine_checkpoints.py) and must end in one NanoEvalError line (exit code 2) without running
code, reading outside its folder, changing process state, allocating past the limit or hanging; the fuzz test
at the end mutates genuine checkpoints of every kind a few hundred times.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from nano_eval.checkpoints.load import LoadOptions, load_backend
from nano_eval.errors import NanoEvalError
from tests.hostile_pickles import _str, call, pickle_bytes, ref, torch_zip, value

pytestmark = pytest.mark.filterwarnings("ignore")
MEGATRON = ("legacy", "torch_dist")


@pytest.fixture
def sentinel(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a payload ran"


def copy_of(genuine: dict, kind: str, tmp_path: Path) -> Path:
    """A private copy of a genuine checkpoint (Megatron and nanotron: with their run folder), its path returned."""
    ckpt = genuine[kind]
    source = ckpt.parent if kind in (*MEGATRON, "nanotron") else ckpt
    dest = tmp_path / f"copy_{kind}"
    shutil.copytree(source, dest, symlinks=True)
    return dest / ckpt.relative_to(source) if source != ckpt else dest


def options(kind: str, toy_checkpoint, **kw) -> LoadOptions:
    return LoadOptions(tokenizer=str(toy_checkpoint) if kind in MEGATRON else None, **kw)


def refused(path, opts: LoadOptions, *, within_s: float = 60) -> str:
    """load_backend must raise one NanoEvalError line (exit code 2) within `within_s` seconds; returns it. (The
    loader may wrap the alarm's exception in a refusal of its own: a fired alarm fails the test however it ended.)"""
    fired = []

    def timeout(signum, frame):
        fired.append(True)
        raise AssertionError(f"loading {path} did not end within {within_s}s")

    previous = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(int(within_s))
    try:
        with pytest.raises(NanoEvalError) as raised:
            load_backend(str(path), opts)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not fired, f"loading {path} did not end within {within_s}s: {raised.value}"
    text = str(raised.value)
    assert raised.value.exit_code == 2 and "\n" not in text and "Fix:" in text, text
    assert not any(w in text for w in ("MemoryError", "DefaultCPUAllocator", "allocate")), text
    return text


def logits(backend) -> torch.Tensor:
    with torch.no_grad():
        return backend.model(input_ids=torch.tensor([[5, 17, 42, 7]])).logits


# ---- torch_dist: the index decides nothing about what is unpickled or read ------------------------------------

def _metadata(iter_dir: Path):
    return pickle.loads((iter_dir / ".metadata").read_bytes())  # a file this test wrote: trusted here


def _save_metadata(iter_dir: Path, metadata) -> None:
    (iter_dir / ".metadata").write_bytes(pickle.dumps(metadata))


class _Runs:
    """torch.save'd, this object runs `command` when torch.load(weights_only=False) reads it back."""

    def __init__(self, command: str, then_tensor: bool):
        self.command, self.then_tensor = command, then_tensor

    def __reduce__(self):
        if self.then_tensor:  # and returns the tensor megatron expects: the run would end normally
            return eval, (f"__import__('os').system({self.command!r}) or __import__('torch').ones(64)",)
        return os.system, (self.command,)


@pytest.mark.parametrize("declares_size", [True, False])
@pytest.mark.parametrize("then_tensor", [True, False])
def test_torch_dist_bytes_entry_for_a_model_tensor_runs_nothing(genuine_checkpoints, toy_checkpoint, tmp_path,
                                                                sentinel, declares_size, then_tensor):
    """The reported attack: `.metadata` (allow-listed classes only) declares decoder.final_layernorm.weight as
    BytesStorageMetadata pointing at a torch.save payload appended to __0_0.distcp; torch.distributed.checkpoint
    would torch.load(weights_only=False) it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    iter_dir = copy_of(genuine_checkpoints, "torch_dist", tmp_path)
    buffer = io.BytesIO()
    torch.save(_Runs(f"touch {sentinel}", then_tensor), buffer)
    payload = buffer.getvalue()
    armed = tmp_path / "armed"
    torch.load(io.BytesIO(payload.replace(str(sentinel).encode(), str(armed).encode().ljust(
        len(str(sentinel)), b"_"))), weights_only=False)
    assert any(p.name.startswith("armed") for p in tmp_path.iterdir()), "the payload is not armed"

    distcp = iter_dir / "__0_0.distcp"
    offset = distcp.stat().st_size
    distcp.write_bytes(distcp.read_bytes() + payload)
    md = _metadata(iter_dir)
    key = "decoder.final_layernorm.weight"
    entry = BytesStorageMetadata()
    if declares_size:
        entry.size = md.state_dict_metadata[key].size  # so that megatron's shape check would pass
    md.state_dict_metadata[key] = entry
    info = next(v for k, v in md.storage_data.items() if k.fqn == key)
    for k in [k for k in md.storage_data if k.fqn == key]:
        del md.storage_data[k]
    md.storage_data[MetadataIndex(key)] = type(info)("__0_0.distcp", offset, len(payload))
    _save_metadata(iter_dir, md)

    text = refused(iter_dir, options("torch_dist", toy_checkpoint))
    assert (".metadata: refused to load" in text) if declares_size else ("stored as pickled bytes" in text), text


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_torch_dist_index_cannot_point_outside_its_folder(genuine_checkpoints, toy_checkpoint, tmp_path, where):
    iter_dir = copy_of(genuine_checkpoints, "torch_dist", tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(iter_dir / "__0_0.distcp", elsewhere / "__0_0.distcp")
    outside = "../../elsewhere/__0_0.distcp" if where == "relative" else str(elsewhere / "__0_0.distcp")
    md = _metadata(iter_dir)
    for k, info in md.storage_data.items():
        md.storage_data[k] = type(info)(outside, info.offset, info.length)
    _save_metadata(iter_dir, md)
    (iter_dir / "__0_0.distcp").unlink()
    text = refused(iter_dir, options("torch_dist", toy_checkpoint))
    assert "not a .distcp file of this folder" in text and str(iter_dir / ".metadata") in text


def test_torch_dist_entry_past_the_end_of_its_file(genuine_checkpoints, toy_checkpoint, tmp_path):
    iter_dir = copy_of(genuine_checkpoints, "torch_dist", tmp_path)
    md = _metadata(iter_dir)
    k, info = next(iter(md.storage_data.items()))
    md.storage_data[k] = type(info)(info.relative_path, info.offset, 1 << 40)
    _save_metadata(iter_dir, md)
    assert "declares bytes" in refused(iter_dir, options("torch_dist", toy_checkpoint))


# ---- symlinks and file names -------------------------------------------------------------------------------------

LINKED = {"hf": "model.safetensors", "hf_bin": "pytorch_model.bin", "legacy": "mp_rank_00/model_optim_rng.pt",
          "torch_dist": "__0_0.distcp",
          "nanotron": "model/model/final_layer_norm/pp_block/model_weight.safetensors"}


@pytest.mark.parametrize("kind", list(LINKED))
def test_a_symlink_out_of_the_folder_is_refused_unless_allowed(genuine_checkpoints, toy_checkpoint, tmp_path, kind):
    ckpt = copy_of(genuine_checkpoints, kind, tmp_path)
    link = ckpt / LINKED[kind]
    outside = tmp_path / "outside" / link.name
    outside.parent.mkdir()
    shutil.move(link, outside)
    link.symlink_to(outside)
    text = refused(ckpt, options(kind, toy_checkpoint))
    assert str(link) in text and "--allow-symlinks-outside" in text, text
    allowed = load_backend(str(ckpt), options(kind, toy_checkpoint, allow_symlinks_outside=True))
    genuine = load_backend(str(genuine_checkpoints[kind]), options(kind, toy_checkpoint))
    assert torch.equal(logits(allowed), logits(genuine))


def test_tokenizer_files_cannot_name_files_outside(genuine_checkpoints, tmp_path):
    ckpt = copy_of(genuine_checkpoints, "hf", tmp_path)
    (ckpt / "vocab.txt").symlink_to("/etc/hostname")
    assert "vocab.txt" in refused(ckpt, LoadOptions())
    (ckpt / "vocab.txt").unlink()
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "vocab_file": "/etc/hostname"}))
    text = refused(ckpt, LoadOptions())
    assert "vocab_file='/etc/hostname'" in text and "tokenizer_config.json" in text


def test_a_fifo_or_device_is_never_opened(genuine_checkpoints, tmp_path):
    ckpt = copy_of(genuine_checkpoints, "hf", tmp_path)
    (ckpt / "config.json").unlink()
    os.mkfifo(ckpt / "config.json")  # reading it would block forever
    assert "is a FIFO" in refused(ckpt, LoadOptions(), within_s=30)
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to("/dev/zero")  # outside, and endless
    assert "config.json" in refused(ckpt, LoadOptions(allow_symlinks_outside=True), within_s=30)


# ---- process state ------------------------------------------------------------------------------------------------

def test_build_on_a_class_in_the_index_is_refused(genuine_checkpoints, toy_checkpoint, tmp_path):
    """BUILD with slot state on pathlib.PosixPath (an allowed name) would setattr on the class, process-wide."""
    import pathlib

    before = dict(vars(pathlib.PosixPath))
    iter_dir = copy_of(genuine_checkpoints, "torch_dist", tmp_path)
    build_on_class = (ref("pathlib", "PosixPath") + b"N" + b"}" + _str("__fspath__") + _str("pwned") + b"s"
                      + b"\x86" + b"b")
    (iter_dir / ".metadata").write_bytes(pickle_bytes(
        ref("torch.distributed.checkpoint.metadata", "Metadata") + b"(" + b"}" + _str("w") + build_on_class
        + b"s" + b"t" + b"R"))
    assert "refused to load" in refused(iter_dir, options("torch_dist", toy_checkpoint))
    assert dict(vars(pathlib.PosixPath)) == before


def test_build_on_an_enum_member_in_megatron_args_changes_nothing(genuine_checkpoints, toy_checkpoint, tmp_path):
    """Megatron's args pickle enum members (signal.Signals.SIGTERM); a BUILD on one would rename it for the whole
    process. Here enum members are opaque records: the BUILD has nothing shared to write to."""
    iter_dir = copy_of(genuine_checkpoints, "legacy", tmp_path)
    enum_member = call("signal", "Signals", 15) + b"}" + _str("_name_") + _str("PWNED") + b"s" + b"b"
    shard = iter_dir / "mp_rank_00" / "model_optim_rng.pt"
    shard.write_bytes(torch_zip(pickle_bytes(b"}" + b"(" + _str("args") + enum_member + _str("iteration")
                                             + value(7) + b"u")))
    refused(iter_dir, options("legacy", toy_checkpoint))
    assert signal.Signals.SIGTERM.name == "SIGTERM" and signal.Signals(15).name == "SIGTERM"


# ---- memory -------------------------------------------------------------------------------------------------------

def test_stride_zero_tensor_is_refused_before_it_is_expanded(genuine_checkpoints, toy_checkpoint, tmp_path):
    iter_dir = copy_of(genuine_checkpoints, "legacy", tmp_path)
    shard = iter_dir / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(shard, weights_only=False)  # the genuine file this test wrote
    state["model"]["embedding.word_embeddings.weight"] = torch.zeros(1).expand(1 << 20, 1 << 20)  # 4 TiB as fp32
    torch.save(state, shard)
    assert shard.stat().st_size < 2 << 20
    assert "repeated elements" in refused(iter_dir, options("legacy", toy_checkpoint))


def test_compressed_records_are_refused(genuine_checkpoints, toy_checkpoint, tmp_path):
    """A zip bomb: deflate turns a few KiB into gigabytes; torch.save never compresses."""
    iter_dir = copy_of(genuine_checkpoints, "legacy", tmp_path)
    shard = iter_dir / "mp_rank_00" / "model_optim_rng.pt"
    with zipfile.ZipFile(shard) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    with zipfile.ZipFile(shard, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, data in records.items():
            z.writestr(name, data)
    assert "compressed record" in refused(iter_dir, options("legacy", toy_checkpoint))


def test_args_declaring_a_huge_vocabulary_are_refused_before_building(genuine_checkpoints, toy_checkpoint, tmp_path):
    from tests.genuine_checkpoints import edit_common_state

    iter_dir = copy_of(genuine_checkpoints, "torch_dist", tmp_path)
    edit_common_state(iter_dir, lambda common: setattr(common["args"], "padded_vocab_size", 2_000_000_000))
    # 512 GB of embeddings at hidden 64
    text = refused(iter_dir, options("torch_dist", toy_checkpoint), within_s=30)
    assert "describe a model of" in text and "files hold only" in text


def test_max_checkpoint_bytes_caps_a_genuine_model(genuine_checkpoints, toy_checkpoint):
    for kind in ("hf", "legacy", "torch_dist", "nanotron"):
        text = refused(genuine_checkpoints[kind], options(kind, toy_checkpoint, max_checkpoint_bytes=1000))
        assert "--max-checkpoint-bytes" in text, text


def test_nanotron_unsharded_shape_larger_than_its_shards(genuine_checkpoints, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)
    shard = next((ckpt / "model").rglob("*token_embedding*/*.safetensors"))
    with safe_open(str(shard), framework="pt") as f:
        data, meta = f.get_tensor("data"), dict(f.metadata())
    meta["unsharded_shape"] = "(1048576, 1048576)"
    save_file({"data": data}, str(shard), metadata=meta)
    assert "declares an unsharded shape" in refused(ckpt, LoadOptions())


def test_yaml_alias_bomb_is_refused_at_once(genuine_checkpoints, tmp_path):
    import time

    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(9))
    (ckpt / "config.yaml").write_text(bomb + (ckpt / "config.yaml").read_text())
    start = time.perf_counter()
    assert "expands to more than" in refused(ckpt, LoadOptions(), within_s=30)
    assert time.perf_counter() - start < 10


# ---- damaged and foreign files: one line each ------------------------------------------------------------------------

def _torchscript(path: Path) -> None:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(path))


def _tar_format(path: Path) -> None:
    torch.save({"model": {}}, path, _use_new_zipfile_serialization=False)


def _meta_tensor(path: Path) -> None:
    torch.save({"model": {"x": torch.empty(4, device="meta")}}, path)


def _storage_archive(path: Path, size, stride, offset) -> None:
    """A torch.save archive whose one tensor is declared at `size`/`stride`/`offset` over a 4-element storage."""
    storage = (b"(" + _str("storage") + ref("torch", "FloatStorage") + _str("0") + _str("cpu") + value(4)
               + b"t" + b"Q")
    tensor = call("torch._utils", "_rebuild_tensor_v2", storage, offset, tuple(size), tuple(stride), False,
                  ref("collections", "OrderedDict") + b")R")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle_bytes(b"}" + _str("model") + b"}" + _str("w") + tensor + b"s" + b"s"))
        z.writestr("archive/data/0", bytes(16))
        z.writestr("archive/byteorder", "little")
    path.write_bytes(buf.getvalue())


def _truncated(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


BAD_SHARDS = {
    "TorchScript archive": (_torchscript, "TorchScript"),
    "pre-1.6 tar format": (_tar_format, "pre-1.6 torch format"),
    "meta tensor": (_meta_tensor, "a meta tensor"),
    "view past its storage": (lambda p: _storage_archive(p, (2,), (1,), 3), "reaches past its storage"),
    "more elements than its storage": (lambda p: _storage_archive(p, (8,), (1,), 0), "declared on a storage of 4"),
    "negative stride": (lambda p: _storage_archive(p, (2,), (-1,), 3), "declares size"),
    "truncated": (_truncated, ""),
    "empty": (lambda p: p.write_bytes(b""), "empty file"),
    "not a torch file": (lambda p: p.write_text("hello"), "not a torch.save archive"),
}


@pytest.mark.parametrize("name", list(BAD_SHARDS))
def test_bad_megatron_shards_end_in_one_line(genuine_checkpoints, toy_checkpoint, tmp_path, name):
    make, expected = BAD_SHARDS[name]
    iter_dir = copy_of(genuine_checkpoints, "legacy", tmp_path)
    shard = iter_dir / "mp_rank_00" / "model_optim_rng.pt"
    make(shard)
    assert expected in refused(iter_dir, options("legacy", toy_checkpoint))


def _index_outside(ckpt: Path) -> None:
    (ckpt / "model.safetensors").rename(ckpt.parent / "shard.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../shard.safetensors"}}))


def _huge_header(ckpt: Path) -> None:
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes((1 << 60).to_bytes(8, "little") + data[8:])


def _drop_a_weight_add_another(ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    weights = load_file(ckpt / "model.safetensors")
    dropped = sorted(weights)[3]
    weights["model.layers.9.mlp.down_proj.weight"] = weights.pop(dropped)
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})


BAD_HF = {
    "index names a shard outside": (_index_outside, "not a file of the checkpoint folder"),
    "huge safetensors header": (_huge_header, "header"),
    "recursion-deep config.json": (lambda c: (c / "config.json").write_text("[" * 100_000 + "]" * 100_000),
                                   "deeper"),
    "config.json is a list": (lambda c: (c / "config.json").write_text("[1, 2]"), "not an object"),
    "config declares a huge model": (lambda c: (c / "config.json").write_text((c / "config.json").read_text().replace(
        '"intermediate_size": 64', '"intermediate_size": 3200000')), "parameters"),
    "config.json not UTF-8": (lambda c: (c / "config.json").write_bytes(b"\xff\xfe{}"), "not UTF-8"),
    # transformers only warns: the missing weight would stay randomly initialised, the other be dropped
    "a weight missing, another unexpected": (_drop_a_weight_add_another,
                                             "missing ['model.layers.0.mlp.down_proj.weight']; unexpected"),
    "config declares -1 layers": (lambda c: (c / "config.json").write_text(re.sub(
        r'"num_hidden_layers": \d+', '"num_hidden_layers": -1', (c / "config.json").read_text())), "-1 layers"),
}


@pytest.mark.parametrize("kind", ["hf", "hf_bin", "nanotron"])
def test_a_config_declaring_billions_of_layers_is_refused_by_arithmetic(genuine_checkpoints, tmp_path, kind):
    """`num_hidden_layers: 2147483648`: building even a meta-device model of it took minutes (found by the fuzz,
    whose alarm the loader had wrapped into a refusal); the layer count is bounded by the weight files' bytes before
    any module is built (nanotron's checkpoints name their layers' files, and that check comes first)."""
    ckpt = copy_of(genuine_checkpoints, kind, tmp_path)
    config = ckpt / ("config.yaml" if kind == "nanotron" else "config.json")
    text = config.read_text()
    edited = re.sub(r'("?num_hidden_layers"?:\s*)\d+', r"\g<1>2147483648", text)
    assert edited != text
    config.write_text(edited)
    text = refused(ckpt, LoadOptions(), within_s=20)
    assert ("do not fit" if kind == "nanotron" else "declares 2,147,483,648 layers") in text, text


@pytest.mark.parametrize("name", list(BAD_HF))
def test_bad_transformers_folders_end_in_one_line(genuine_checkpoints, tmp_path, name):
    make, expected = BAD_HF[name]
    ckpt = copy_of(genuine_checkpoints, "hf", tmp_path)
    make(ckpt)
    assert expected in refused(ckpt, LoadOptions())


def test_the_command_line_prints_one_line_and_exits_2(genuine_checkpoints, toy_checkpoint, tmp_path, capsys):
    from nano_eval.cli import main

    iter_dir = copy_of(genuine_checkpoints, "legacy", tmp_path)
    _torchscript(iter_dir / "mp_rank_00" / "model_optim_rng.pt")
    code = main(["--checkpoint", str(iter_dir), "--tokenizer", str(toy_checkpoint), "--tasks", "demo|arithmetic|0",
                 "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    [line] = [x for x in err.splitlines() if x.startswith("nano_eval: error:")]
    assert "TorchScript" in line and "Fix:" in line


# ---- fuzz ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("per_kind, seed", [(30, 0), pytest.param(100, 1, marks=pytest.mark.slow)])
def test_fuzzed_checkpoints_end_in_exit_2_or_load(genuine_checkpoints, toy_checkpoint, tmp_path, per_kind, seed):
    """Seeded mutations of genuine checkpoints (tests/checkpoint_fuzz.py; `per_kind` of each kind), in a process
    under an address-space limit: none crashes, hangs, allocates past its limit or changes process state; each is
    refused in one line or loads. A load with other scores is only possible where the mutation changed bytes the
    format cannot check (tensor data, a float argument)."""
    from tests.genuine_checkpoints import KINDS

    report_path = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "tests.checkpoint_fuzz", str(genuine_checkpoints["hf"].parent),
                           str(toy_checkpoint), str(tmp_path / "work"), str(report_path), "--seed", str(seed),
                           "--per-kind", str(per_kind)], capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(report_path.read_text())
    cases = report["cases"]
    bad = [c for c in cases if c["outcome"] not in ("refused", "same", "different")]
    assert not bad, json.dumps(bad[:5], indent=1)
    assert report["state_unchanged"]
    assert len(cases) == per_kind * len(KINDS)
    for kind in KINDS:
        outcomes = {c["outcome"] for c in cases if c["kind"] == kind}
        assert "refused" in outcomes and outcomes & {"same", "different"}, (kind, outcomes)
    assert not [c for c in cases if c["outcome"] == "different" and c["mutation"].startswith("truncate")]


def test_a_declared_bytearray_length_is_checked_before_allocating():
    """BYTEARRAY8 (protocol 5): Python's unpickler allocates the declared length before reading, so one flipped
    length byte in a shard's data.pkl asked for up to 2**63 bytes (found by the fuzz as a MemoryError under its
    address-space limit; without one, gigabytes). The length is checked against the pickle's own size first."""
    import struct

    from nano_eval.checkpoints.pickles import TENSORS, unpickle

    assert unpickle(b"\x80\x05\x96" + struct.pack("<Q", 3) + b"abc.", TENSORS, "x.pt") == bytearray(b"abc")
    with pytest.raises(NanoEvalError, match=r"x.pt: refused to load \(UnpicklingError: BYTEARRAY8 declares "
                                            r"1,099,511,627,776 bytes, more than the 15 bytes"):
        unpickle(b"\x80\x05\x96" + struct.pack("<Q", 1 << 40) + b"abc.", TENSORS, "x.pt")
