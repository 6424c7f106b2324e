"""No number from a broken model (issue 35, item 3).

A checkpoint whose config or weights make the model output NaN or inf (`rope_theta: 0`, a NaN weight) must not be
reported as a score (a NaN log-prob compares false and reads as accuracy 0.0): the task fails with one line naming
the task and the document, exit code 2 from the command line, a failed task in a sweep (the sweep goes on) and in the
training hook (training goes on). Configs that are broken by a field's value are refused at load, naming the field.
A nanotron checkpoint whose shard slices leave part of a tensor unwritten (torch.empty memory) is refused, and so is
one whose slice metadata lists more pairs than the tensor has elements (it used to hang the loader).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nano_eval.checkpoints.load import LoadOptions
from tests.test_hostile_files import copy_of, refused

pytestmark = pytest.mark.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]


# ---- nanotron shards: every element written exactly once ----------------------------------------------------------

def _rewrite_shard(ckpt: Path, pattern: str, edit) -> Path:
    """Rewrite the first shard file matching `pattern` under model/: edit(data, metadata) -> (data, metadata)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shard = next((ckpt / "model").rglob(pattern))
    with safe_open(str(shard), framework="pt") as f:
        data, meta = f.get_tensor("data"), dict(f.metadata())
    data, meta = edit(data, meta)
    save_file({"data": data.contiguous()}, str(shard), metadata=meta)
    return shard


def _rows(meta: dict) -> int:
    return int(meta["unsharded_shape"].strip("()").split(",")[0])


def test_nanotron_slices_that_leave_rows_unwritten_are_refused(genuine_checkpoints, tmp_path):
    """The shard keeps all its bytes, but its one slice pair now writes only the first 8 rows: the other rows of the
    merged embedding would be torch.empty memory (scores that change from one load to the next)."""
    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)

    def first_rows(data, meta):
        assert meta["local_global_slices_pairs"].count(";") == 0, meta  # the genuine tp=1 shard: one pair
        meta["local_global_slices_pairs"] = "0,8,None|None,None,None#0,8,None|None,None,None"
        return data, meta

    _rewrite_shard(ckpt, "*token_embedding*/*.safetensors", first_rows)
    text = refused(ckpt, LoadOptions())
    assert "token_embedding" in text and "uninitialised" in text, text


def test_nanotron_overlapping_slices_are_refused(genuine_checkpoints, tmp_path):
    """Two pairs write the same rows (and none writes the last ones): refused, not merged in file order."""
    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)

    def overlap(data, meta):
        rows = _rows(meta)
        meta["local_global_slices_pairs"] = (f"0,{rows - 1},None|None,None,None#0,{rows - 1},None|None,None,None;"
                                             f"0,1,None|None,None,None#0,1,None|None,None,None")
        return data, meta

    _rewrite_shard(ckpt, "*token_embedding*/*.safetensors", overlap)
    assert "overlaps" in refused(ckpt, LoadOptions())


def test_nanotron_millions_of_slice_pairs_are_refused_at_once(genuine_checkpoints, tmp_path):
    """1.5 million one-row pairs for a tensor of far fewer elements: refused before any pair is parsed (the loader
    used to copy them one by one for minutes)."""
    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)

    def many(data, meta):
        meta["local_global_slices_pairs"] = ";".join(["0,1,None|None,None,None#0,1,None|None,None,None"] * 1_500_000)
        return data, meta

    shard = _rewrite_shard(ckpt, "*token_embedding*/*.safetensors", many)
    start = time.perf_counter()
    text = refused(ckpt, LoadOptions(), within_s=30)
    assert "1,500,000 slice pairs" in text and shard.name in text, text
    assert time.perf_counter() - start < 10


def test_nanotron_shards_split_in_row_chunks_merge_exactly(genuine_checkpoints, tmp_path):
    """The same embedding saved as two chunk pairs, in reverse order (as nanotron's contiguous_chunks write): the
    check accepts an exact cover, and the model scores as the genuine one does."""
    from nano_eval.checkpoints.nanotron import read_nanotron_weights

    ckpt = copy_of(genuine_checkpoints, "nanotron", tmp_path)

    def two_chunks(data, meta):
        half = _rows(meta) // 2
        meta["local_global_slices_pairs"] = (f"{half},None,None|None,None,None#{half},None,None|None,None,None;"
                                             f"0,{half},None|None,None,None#0,{half},None|None,None,None")
        return data, meta

    _rewrite_shard(ckpt, "*token_embedding*/*.safetensors", two_chunks)
    name = "model.token_position_embeddings.pp_block.token_embedding.weight"
    assert torch.equal(read_nanotron_weights(ckpt)[name], read_nanotron_weights(genuine_checkpoints["nanotron"])[name])
