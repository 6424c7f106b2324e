"""`--backend megatron`: megatron-core's own GPTModel, built from a checkpoint's args in a TP x PP x EP layout.

    torchrun --nproc_per_node=N nano_eval/run.py --checkpoint ITER_DIR_OR_RUN_DIR --tokenizer T \\
        --backend megatron --tp T --pp P [--ep E] --tasks ...

Every rank builds its stage of the model from the checkpoint's own args as Megatron-LM built it (megatron_config.py:
every argument that changes the math applied or refused by name; megatron_model.py builds it: dense or MoE) and
loads its share:
- torch_dist, saved in any layout: megatron-core's `dist_checkpointing.load` reshards it, reading through
  nano_eval's checked reader (megatron_dist.py: the index validated whole, tensor chunks only);
- legacy `mp_rank_*` shards: the rank's own shard, read by nano_eval's unpickler, when the saved TP x PP (x EP)
  equals the requested one.
The backend is nano_eval.backends.megatron.MegatronModel on the loaded model: scores in the model's own layout,
vocab-parallel, as for a live training model. Data parallelism is what is left of the world (world / (tp x pp)).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from nano_eval.checkpoints.files import load_tokenizer
from nano_eval.checkpoints.megatron_args import args_dict, check_model_size, load_shard
from nano_eval.checkpoints.megatron_config import refuse_unsupported, translate, unfold_zero_centered_gamma
from nano_eval.checkpoints.megatron_dist import COMMON, is_dist_checkpoint, load_sharded, open_dist_checkpoint
from nano_eval.checkpoints.megatron_legacy import SHARD_DIR, resolve_iteration_dir, shard_files
from nano_eval.checkpoints.megatron_model import build_gpt_model
from nano_eval.checkpoints.untrusted import CheckpointFileError, FilePolicy, Folder
from nano_eval.errors import NanoEvalError


def load_native(checkpoint: str, tokenizer: str | None, *, tp: int, pp: int, ep: int, dtype: str,
                max_length: int | None, device: str, policy: FilePolicy = FilePolicy()):
    """A MegatronModel backend holding the checkpoint's model in tp x pp x ep (every rank of the world calls it)."""
    from nano_eval.backends.megatron import MegatronModel
    from nano_eval.compat.megatron import (import_megatron_core, initialize_model_parallel_for_eval,
                                           reset_model_parallel)

    import_megatron_core()  # or say how to install it
    if not tokenizer:
        raise NanoEvalError(f"checkpoint {checkpoint}: Megatron checkpoints do not hold a tokenizer. "
                            "Fix: pass --tokenizer PATH_OR_HUB_ID (the one the run trained with).")
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world % (tp * pp) or (world // (tp * pp)) % ep:
        raise NanoEvalError(f"--backend megatron at tp={tp} x pp={pp} x ep={ep} needs a world size divisible by "
                            f"tp x pp = {tp * pp} whose data-parallel part divides by ep (WORLD_SIZE={world}). Fix: "
                            f"torchrun --nproc_per_node={tp * pp * ep} nano_eval/run.py ...")
    tok = load_tokenizer(tokenizer, checkpoint, policy=policy)
    iter_dir = Folder(resolve_iteration_dir(checkpoint, policy), policy).check().root
    legacy = not is_dist_checkpoint(iter_dir) or any(SHARD_DIR.match(p.name) for p in iter_dir.iterdir())
    files = _legacy_files(iter_dir, (tp, pp, ep), policy) if legacy else None  # a layout mismatch: before any setup
    if not dist.is_initialized():  # one process without torchrun: a world of one on an in-memory store
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    reset_model_parallel()  # the previous checkpoint's layout, groups included (a sweep loads one after another)
    initialize_model_parallel_for_eval(tp=tp, pp=pp, ep=ep, device=device)
    torch_dtype = getattr(torch, dtype)
    if legacy:
        model, args = _load_legacy(files, torch_dtype, policy)
    else:
        model, args = _load_dist(iter_dir, tp * pp, torch_dtype, policy)
    if device.startswith("cuda"):
        model = model.cuda()
    length = max_length or args.get("max_position_embeddings") or args.get("seq_length")
    return MegatronModel(model.eval(), tok, max_length=int(length))


def _load_dist(iter_dir: Path, model_parallel: int, dtype: torch.dtype, policy: FilePolicy):
    """(this rank's GPTModel stage holding its share of a torch_dist checkpoint, args)."""
    ckpt = open_dist_checkpoint(iter_dir, policy)
    share = FilePolicy(allow_symlinks_outside=policy.allow_symlinks_outside,
                       max_bytes=policy.byte_limit() * model_parallel)  # each rank holds about 1 / (tp x pp)
    refuse_unsupported(ckpt.args)  # by name, before the sizes are checked or anything is built
    check_model_size(ckpt.args, ckpt.folder.root / COMMON, disk_bytes=ckpt.data_bytes, policy=share)
    model = build_gpt_model(ckpt.args, dtype=dtype)
    loaded = load_sharded(model, ckpt, "check --tp / --pp / --ep against the model (heads, query groups and "
                                       "experts must divide), or pass the run's own args.")
    _fill(model, loaded, iter_dir)
    _as_trained(model, ckpt.args)
    return model, ckpt.args


def _legacy_files(iter_dir: Path, layout: tuple[int, int, int], policy: FilePolicy) -> dict:
    """{(tp_rank, pp_rank, ep_rank): shard} of a legacy checkpoint saved in exactly `layout`."""
    files = shard_files(Folder(iter_dir, policy), allow_expert_shards=True)
    saved = tuple(max(k[i] for k in files) + 1 for i in range(3))
    if saved != layout:
        raise NanoEvalError(f"{iter_dir}: a legacy checkpoint saved at tp={saved[0]} x pp={saved[1]} x ep={saved[2]} "
                            f"loads only in that layout, not tp={layout[0]} x pp={layout[1]} x ep={layout[2]}. Fix: "
                            f"pass --tp {saved[0]} --pp {saved[1]} --ep {saved[2]}, or convert it to torch_dist.")
    return files


def _load_legacy(files: dict, dtype: torch.dtype, policy: FilePolicy):
    """(this rank's GPTModel stage holding its legacy shard, args)."""
    from megatron.core import parallel_state as ps

    rank = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
            ps.get_expert_model_parallel_rank())
    shard = load_shard(files[rank])
    args = args_dict(shard.get("args"))
    state = shard.get("model")
    if not isinstance(state, dict):
        raise CheckpointFileError(files[rank], "has no 'model' state dict (virtual-pipeline checkpoints, with "
                                  "model0, model1, ..., are not supported)")
    refuse_unsupported(args)
    check_model_size(args, files[rank], disk_bytes=files[rank].stat().st_size * len(files), policy=policy)
    model = build_gpt_model(args, dtype=dtype)
    if translate(args).mtp_layers:  # multi-token-prediction heads: the main logits never read them
        state = {k: v for k, v in state.items() if not (isinstance(k, str) and k.startswith("mtp."))}
    _fill(model, state, files[rank])
    _as_trained(model, args)
    return model, args


def _as_trained(model, args: dict) -> None:
    """What the loaded weights need to compute what the run computed: norm weights stored zero-centred
    (`--apply-layernorm-1p`) get their 1 back (megatron_config.unfold_zero_centered_gamma)."""
    if translate(args).zero_centered_gamma:
        unfold_zero_centered_gamma(model)


def _fill(model, state: dict, where: Path) -> None:
    """Copy `state` into the model; every weight must be there with its shape, and no other weight (extra state may
    be absent): args declaring fewer layers than were saved would otherwise drop the rest and still score."""
    expected = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)
               and not k.endswith("_extra_state")}
    missing = [k for k in expected if k not in tensors]
    unexpected = [k for k in tensors if k not in expected]
    wrong = [f"{k} {tuple(tensors[k].shape)} (model: {tuple(v.shape)})" for k, v in expected.items()
             if k in tensors and tensors[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise CheckpointFileError(where, f"does not fit the model its args describe (missing {missing[:4]}, "
                                  f"unexpected {unexpected[:4]}, wrong shapes {wrong[:3]})", "check that --tp / --pp "
                                  "/ --ep and the checkpoint's args match the saved weights")
    with torch.no_grad():
        for k, v in expected.items():
            v.copy_(tensors[k])
