"""Genuine checkpoints of every kind nano_eval reads, written by the frameworks' own save functions, for the
hostile-file and fuzz tests:

  hf          transformers' save_pretrained (safetensors) with the toy tokenizer
  hf_bin      the same weights as pytorch_model.bin (the torch.save'd state dict older transformers write)
  nanotron    nanotron 0.4's own save_weights / save_meta (its real LlamaForTraining, CPU test double)
  legacy      Megatron-LM's legacy iter_XXXXXXX/mp_rank_00/model_optim_rng.pt: torch.save of megatron-core's
              GPTModel state dict with Megatron's args and an RNG state (numpy arrays inside)
  torch_dist  megatron-core's dist_checkpointing.save of the same GPTModel (torch.distributed.checkpoint files)

Run as `python -m tests.genuine_checkpoints OUT TOKENIZER_DIR` in a fresh process: it installs the CPU test doubles
(tests/megatron_cpu.py, tests/nanotron_cpu.py), which must not leak into the pytest process, and starts a 1-process
gloo group on an in-memory store. Models are tiny (hidden 32-64), so hundreds of loads take seconds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ITERATION = 7
KINDS = ("hf", "hf_bin", "nanotron", "legacy", "torch_dist")


def paths(root: Path) -> dict[str, Path]:
    """{kind: the checkpoint path to load} under `root`."""
    root = Path(root)
    return {"hf": root / "hf", "hf_bin": root / "hf_bin", "nanotron": root / "nanotron" / str(ITERATION),
            "legacy": root / "legacy" / f"iter_{ITERATION:07d}",
            "torch_dist": root / "torch_dist" / f"iter_{ITERATION:07d}"}


def make_hf(root: Path, tokenizer_dir: Path, *, safetensors: bool = True) -> Path:
    """A tiny transformers Llama saved with save_pretrained, with the toy tokenizer beside it; `safetensors=False`:
    its weights as `pytorch_model.bin` instead."""
    import torch
    from transformers import AutoTokenizer

    from nano_eval.toy import build_model

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    model = build_model(len(tokenizer), seed=3, hidden=32, layers=1)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    if not safetensors:
        (root / "model.safetensors").unlink()
        torch.save(model.state_dict(), root / "pytorch_model.bin")
    return root


def make_megatron(root: Path) -> None:
    """The tiny GPTModel of tests/megatron_gpt.py saved as legacy and torch_dist (megatron_worker's savers)."""
    from tests.megatron_gpt import GPTConfig, megatron_args
    from tests.megatron_worker import _setup, gpt_model_from_args, save_dist_checkpoint, save_legacy_checkpoint

    _setup(1, 1)
    args = megatron_args(GPTConfig(), tp=1, pp=1)
    model = gpt_model_from_args(args)
    save_legacy_checkpoint(model, args, root / "legacy", ITERATION)
    save_dist_checkpoint(model, args, root / "torch_dist", ITERATION)


def edit_common_state(iter_dir: Path, edit) -> None:
    """Apply `edit(common dict)` to a torch_dist checkpoint's common state where the installed megatron-core saved
    it: common.pt (up to 0.18), or the index's common_state entry (0.19: the new torch.save'd [dict] is appended to
    its .distcp file and the entry points there). The test's own genuine files: plain torch.load / pickle."""
    import io
    import pickle

    import torch

    from nano_eval.checkpoints.megatron_dist import COMMON_STATE

    if (iter_dir / "common.pt").is_file():
        common = torch.load(iter_dir / "common.pt", weights_only=False)
        edit(common)
        torch.save(common, iter_dir / "common.pt")
        return
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = pickle.loads((iter_dir / ".metadata").read_bytes())
    info = index.storage_data[MetadataIndex(COMMON_STATE)]
    data = iter_dir / info.relative_path
    with data.open("rb") as f:
        f.seek(info.offset)
        common = torch.load(io.BytesIO(f.read(info.length)), weights_only=False)[0]
    edit(common)
    blob = io.BytesIO()
    torch.save([common], blob)
    info.offset, info.length = data.stat().st_size, len(blob.getvalue())
    with data.open("ab") as f:
        f.write(blob.getvalue())
    (iter_dir / ".metadata").write_bytes(pickle.dumps(index))


def make_all(root: Path, tokenizer_dir: Path) -> dict[str, Path]:
    import os

    import torch.distributed as dist

    from tests.sweep_utils import save_nanotron_run

    root = Path(root)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    make_hf(root / "hf", tokenizer_dir)
    make_hf(root / "hf_bin", tokenizer_dir, safetensors=False)
    make_megatron(root)
    save_nanotron_run(0, 1, str(root / "nanotron"), str(tokenizer_dir), [ITERATION], 64)
    return paths(root)


if __name__ == "__main__":
    made = make_all(Path(sys.argv[1]), Path(sys.argv[2]))
    print(json.dumps({k: str(v) for k, v in made.items()}))
