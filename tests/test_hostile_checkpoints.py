"""No checkpoint file can run code: every file of the hostile corpus (tests/hostile_pickles.py) is refused with a
`nano_eval: error:`-style message, and none of its payloads leaves its mark.

Each file kind the product unpickles is covered: a torch_dist `.metadata` (our own allow-listed unpickler), its
common state (`common.pt`, or megatron-core 0.19's `common_state` entry inside a .distcp file), a legacy `model_optim_rng.pt` and a transformers `pytorch_model.bin` (torch.load(weights_only=True)).
"""

import pickle
from argparse import Namespace

import pytest
import torch

from nano_eval.errors import NanoEvalError
from tests.hostile_pickles import (
    checkpoint_pickle,
    live_payloads,
    metadata_pickle,
    payloads,
    pickle_bytes,
    torch_zip,
)

NESTINGS = ("plain", "dict", "tuple", "list")


@pytest.fixture
def sentinel(tmp_path):
    path = tmp_path / "pwned"
    yield path
    assert not path.exists(), "a payload ran"


def test_the_corpus_is_armed(tmp_path):
    """Plain pickle.loads runs these payloads: a refusal below is the allow-list's doing, not an inert corpus."""
    for p in live_payloads(tmp_path / "ran"):
        (tmp_path / "ran").unlink(missing_ok=True)
        try:
            pickle.loads(pickle_bytes(p.body))
        except Exception:  # noqa: BLE001 - some payloads fail after their side effect (e.g. exec returns None)
            pass
        assert (tmp_path / "ran").exists(), p.name


def _dist_checkpoint(root, metadata: bytes):
    iter_dir = root / "iter_0000005"
    iter_dir.mkdir()
    torch.save({"args": Namespace(num_layers=1), "iteration": 5}, iter_dir / "common.pt")
    (iter_dir / ".metadata").write_bytes(metadata)
    (iter_dir / "__0_0.distcp").write_bytes(b"")
    return iter_dir


def test_torch_dist_metadata_is_refused(tmp_path, sentinel):
    from nano_eval.checkpoints.megatron_dist import read_metadata_safely

    for i, p in enumerate(payloads(sentinel)):
        for how in NESTINGS:
            root = tmp_path / f"{i}_{how}"
            root.mkdir()
            iter_dir = _dist_checkpoint(root, metadata_pickle(p, how))
            with pytest.raises(NanoEvalError, match=r"\.metadata: refused to load"):
                read_metadata_safely(iter_dir)
            assert not sentinel.exists(), f"{p.name} ({how}) ran"


def _common_state_index(length: int) -> bytes:
    """megatron-core 0.19's torch_dist index: one bytes entry, the common state, at bytes 0..length of
    __0_0.distcp."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    from nano_eval.checkpoints.megatron_dist import COMMON_STATE

    return pickle.dumps(Metadata(state_dict_metadata={COMMON_STATE: BytesStorageMetadata()},
                                 storage_data={MetadataIndex(COMMON_STATE): _StorageInfo("__0_0.distcp", 0, length)}))


@pytest.mark.parametrize("kind", ["common.pt", "common_state in a .distcp file", "legacy model_optim_rng.pt"])
def test_megatron_pickles_are_refused(tmp_path, sentinel, kind):
    from nano_eval.checkpoints.megatron_dist import read_common
    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf

    for i, p in enumerate(payloads(sentinel)):
        for how in NESTINGS:
            iter_dir = tmp_path / f"{i}_{how}" / "iter_0000005"
            if kind == "common.pt":
                iter_dir.mkdir(parents=True)
                (iter_dir / "common.pt").write_bytes(torch_zip(checkpoint_pickle(p, how)))
                load = lambda: read_common(iter_dir)  # noqa: E731
            elif kind.startswith("common_state"):  # megatron-core 0.19 writes no common.pt
                iter_dir.mkdir(parents=True)
                blob = torch_zip(checkpoint_pickle(p, how))
                (iter_dir / "__0_0.distcp").write_bytes(blob)
                (iter_dir / ".metadata").write_bytes(_common_state_index(len(blob)))
                load = lambda: load_megatron_llama_as_hf(iter_dir)  # noqa: E731
            else:
                (iter_dir / "mp_rank_00").mkdir(parents=True)
                (iter_dir / "mp_rank_00" / "model_optim_rng.pt").write_bytes(torch_zip(checkpoint_pickle(p, how)))
                load = lambda: load_megatron_llama_as_hf(iter_dir)  # noqa: E731
            with pytest.raises(NanoEvalError, match="refused to load"):
                load()
            assert not sentinel.exists(), f"{p.name} ({how}) ran"


def test_transformers_bin_is_refused(tmp_path, sentinel, toy_checkpoint):
    """pytorch_model.bin goes through nano_eval's reader too: transformers never unpickles it."""
    import shutil

    from nano_eval.checkpoints.hf import load_transformers

    for i, p in enumerate(payloads(sentinel)):
        ckpt = tmp_path / str(i)
        shutil.copytree(toy_checkpoint, ckpt)
        (ckpt / "model.safetensors").unlink()
        (ckpt / "pytorch_model.bin").write_bytes(torch_zip(checkpoint_pickle(p, "dict")))
        with pytest.raises(NanoEvalError, match="pytorch_model.bin: refused to load"):
            load_transformers(str(ckpt))
        assert not sentinel.exists(), f"{p.name} ran"


def test_the_command_line_refuses_the_reported_attack(tmp_path, sentinel, toy_checkpoint, capsys):
    """`nano_eval --checkpoint <downloaded Megatron checkpoint>`: exit 2, one error line, nothing ran."""
    from nano_eval.cli import main

    attack = next(p for p in payloads(sentinel) if p.name.startswith("megatron filesystem_async"))
    iter_dir = _dist_checkpoint(tmp_path, metadata_pickle(attack, "dict"))
    code = main(["--checkpoint", str(iter_dir), "--tokenizer", str(toy_checkpoint), "--tasks", "demo|arithmetic|0",
                 "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "nano_eval: error:" in err and "refused to load" in err and "Traceback" not in err
    assert "weights_only=False" not in err


def test_a_genuine_index_still_loads(tmp_path):
    """The allow-list is not so tight that real files fail: a Metadata pickled by torch itself is read back."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from nano_eval.checkpoints.megatron_dist import read_metadata_safely

    md = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size([4, 2]),
            chunks=[ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([4, 2]))])},
        storage_data={MetadataIndex("w", torch.Size([0, 0])): _StorageInfo("__0_0.distcp", 0, 64)},
        storage_meta=StorageMeta(checkpoint_id=tmp_path))
    iter_dir = _dist_checkpoint(tmp_path, pickle.dumps(md))
    (iter_dir / "__0_0.distcp").write_bytes(bytes(64))
    loaded = read_metadata_safely(iter_dir)
    assert loaded.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    assert loaded.state_dict_metadata["w"].size == torch.Size([4, 2])
