"""Code that runs inside the spawned ranks of tests/test_megatron_native_paths.py: torch_dist checkpoints saved the
way Megatron-LM saves them in training, loaded by `--backend megatron` (megatron_native.load_native) in the same
world, and compared logit for logit with the live model that was saved.

- `distributed_optimizer`: Megatron-LM's default save of a run with `--use-distributed-optimizer`: megatron-core
  DDP + DistributedOptimizer after one Adam step, the optimizer's sharded state (`dp_reshardable`, Megatron-LM's
  default sharding type) saved next to the model with the scheduler state, and the content metadata Megatron-LM
  writes (`_build_sharded_state_dict_metadata`).
- `singleton_local_shards`: the same model saved with that content-metadata flag set.
"""

from __future__ import annotations

from argparse import Namespace
from pathlib import Path

import torch

ITERATION = 1


def _live_logits(model, ids):
    from nano_eval.backends.megatron import MegatronModel
    from nano_eval.compat.megatron import unwrap

    with torch.no_grad():
        return unwrap(model).eval()(*MegatronModel._inputs(ids))


def _save(model, optimizer, args: Namespace, root: Path, metadata: dict) -> None:
    """What Megatron-LM's save_checkpoint writes for --ckpt-format torch_dist: model and (if any) optimizer sharded
    state with `metadata` (+ the dp_cp group), the scheduler's plain state, an RNG ShardedObject per rank; the
    content metadata in the common state (common.pt, or 0.19's common_state entry); rank 0 writes the tracker."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedObject

    from nano_eval.compat.megatron import unwrap

    full = {**metadata, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": unwrap(model).sharded_state_dict(metadata=full)}  # save_checkpoint unwraps DDP
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=full)
        state["opt_param_scheduler"] = {"max_lr": 1e-2, "min_lr": 0.0, "num_steps": ITERATION, "warmup_steps": 0,
                                        "decay_steps": 10, "decay_style": "cosine", "start_wd": 0.0, "end_wd": 0.0,
                                        "wd_incr_style": "constant", "wd_incr_steps": 10}
    state["rng_state"] = ShardedObject("rng_state", [{"torch_rng_state": torch.get_rng_state()}],
                                       (1, ps.get_tensor_model_parallel_world_size()),
                                       (0, ps.get_tensor_model_parallel_rank()),
                                       replica_id=ps.get_data_parallel_rank())
    state["num_floating_point_operations_so_far"] = 0
    iter_dir = root / f"iter_{ITERATION:07d}"
    iter_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(iter_dir), content_metadata=metadata)  # megatron-core's writer
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()  # after the tracker: a rank that loads the run dir next must find it


def _trained_with_distributed_optimizer():
    """megatron-core DDP + DistributedOptimizer over this world's data-parallel ranks after one Adam step."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.megatron_gpt import GPTConfig, build_gpt_chunks
    from tests.megatron_worker import SEQ, _batches, _loss_step

    cfg = GPTConfig()
    chunk = build_gpt_chunks(cfg)[0]
    config = chunk.config
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), chunk)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                       params_dtype=torch.float32), [model])
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, model.no_sync
    model.train()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    data = _batches(0, ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), cfg.vocab_size)
    get_forward_backward_func()(forward_step_func=_loss_step, data_iterator=iter(data), model=[model],
                                num_microbatches=len(data), seq_length=SEQ, micro_batch_size=1, forward_only=False)
    optimizer.step()
    return model, optimizer


def native_paths(rank, world, tokenizer_dir, root) -> dict:
    """{case: {"max_diff": loaded vs live logits, "moved": how far one Adam step moved the logits}} or {"error"}."""
    from tests.megatron_gpt import GPTConfig, megatron_args
    from tests.megatron_worker import _setup

    from nano_eval.checkpoints.megatron_native import load_native

    root = Path(root)
    ids = torch.randint(0, GPTConfig().vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    out = {}
    for case, metadata, optimized in [
            ("distributed optimizer (dp_reshardable)", {"distrib_optim_sharding_type": "dp_reshardable"}, True),
            ("singleton_local_shards", {"singleton_local_shards": True}, False)]:
        _setup(1, gloo_groups=optimized)
        from tests.megatron_gpt import build_gpt_chunks

        before = _live_logits(build_gpt_chunks(GPTConfig())[0], ids)
        model, optimizer = _trained_with_distributed_optimizer() if optimized else (
            build_gpt_chunks(GPTConfig())[0], None)
        live = _live_logits(model, ids)
        args = megatron_args(GPTConfig())
        args.use_distributed_optimizer = optimized
        _save(model, optimizer, args, root / case.split()[0],
              {"singleton_local_shards": False, "chained_optim_avoid_prefix": True, **metadata})
        try:
            backend = load_native(str(root / case.split()[0]), str(tokenizer_dir), tp=1, pp=1, ep=1,
                                  dtype="float32", max_length=None, device="cpu")
            loaded = _live_logits(backend.chunks[0], ids)
            out[case] = {"max_diff": (loaded - live).abs().max().item(),
                         "moved": (live - before).abs().max().item(), **_saved_entries(root / case.split()[0])}
        except Exception as e:  # noqa: BLE001 -- the test expects none
            out[case] = {"error": f"{type(e).__name__}: {e}"[:400]}
    return out


def _saved_entries(run_dir: Path) -> dict:
    """How many optimizer entries the checkpoint's index and common.pt hold (read by nano_eval's readers)."""
    from nano_eval.checkpoints.megatron_dist import read_common, read_metadata_safely

    iter_dir = run_dir / f"iter_{ITERATION:07d}"
    index = read_metadata_safely(iter_dir).state_dict_metadata
    return {"optimizer_entries": sum(k.startswith("optimizer") for k in index),
            "common_optimizer": "optimizer" in read_common(iter_dir)}


class _GroupedGemm:
    """TEST DOUBLE for the `grouped_gemm` CUDA package that megatron-core's GroupedMLP (--moe-grouped-gemm with
    the legacy grouped GEMM) calls: `ops.gmm(a, b, batch_sizes, trans_b)` multiplies each expert's consecutive rows
    of `a` by its matrix of `b`, in plain torch."""

    class ops:  # noqa: N801 -- the package's own name
        @staticmethod
        def gmm(a, b, batch_sizes, trans_b=False):
            out, start = [], 0
            for i, n in enumerate(batch_sizes.tolist()):
                out.append(a[start:start + n] @ (b[i].t() if trans_b else b[i]))
                start += n
            return torch.cat(out) if out else a.new_zeros(0, b.shape[1] if trans_b else b.shape[2])


def _moe_model(grouped: bool):
    """The tests' MoE GPTModel (tests/megatron_moe.py: 4 SwiGLU experts, top-2, dropless, alltoall) in this rank's
    expert-parallel layout, with SequentialMLP experts or (grouped) GroupedMLP's two stacked weights. Weights are
    seeded by name (expert weights also by EP rank), so data-parallel replicas hold the same model."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from tests.megatron_gpt import GPTConfig
    from tests.megatron_moe import EXPERTS, moe_config

    if grouped:  # megatron-core <= 0.16 (has_grouped_mlp)
        from megatron.core.transformer.moe import grouped_gemm_util

        grouped_gemm_util.grouped_gemm, grouped_gemm_util.ops = _GroupedGemm, _GroupedGemm.ops
    model_parallel_cuda_manual_seed(1234)
    cfg = GPTConfig()
    config = moe_config(cfg, expert_model_parallel_size=ps.get_expert_model_parallel_world_size())
    config.moe_grouped_gemm = grouped
    legacy = {"moe_use_legacy_grouped_gemm": grouped} if grouped else {}  # the argument is gone from 0.17
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=grouped, normalization="RMSNorm", **legacy)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, parallel_output=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope",
                     rotary_base=int(cfg.rotary_base))
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = f"{name}@ep{ps.get_expert_model_parallel_rank()}" if "experts" in name else name
            seed = int.from_bytes(key.encode()[-8:].ljust(8, b"\0"), "little") ^ len(key)
            full = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
            param.copy_(1.0 + 0.1 * full if "layernorm" in name else full * (1.0 if "word_embeddings" in name
                                                                              else 0.2))
    return model.eval()


def has_grouped_mlp() -> bool:
    """Whether the installed megatron-core has GroupedMLP (the legacy grouped GEMM, gone from 0.17: its grouped
    experts are TEGroupedMLP, which needs Transformer Engine; nano_eval.compat.megatron.Release.experts)."""
    from nano_eval.compat.megatron import release

    row = release()
    return row is not None and "GroupedMLP" in row.experts


def moe_cases() -> list:
    """(name, saved ep, grouped GEMM, singleton_local_shards, eps to load in) of the world of 2: grouped-GEMM experts
    saved at ep2 where the release builds them on CPU (else SequentialMLP saved at ep2), loaded into SequentialMLP
    at ep2 and ep1; SequentialMLP experts saved at ep1 with singleton_local_shards, loaded at ep2 and ep1."""
    first = (("grouped GEMM at ep2 -> SequentialMLP", 2, True, False, (2, 1)) if has_grouped_mlp()
             else ("SequentialMLP at ep2", 2, False, False, (2, 1)))
    return [first, ("SequentialMLP at ep1, singleton_local_shards", 1, False, True, (2, 1))]


def ep4_cases() -> list:
    """The slow set's world of 4: SequentialMLP saved at ep4, loaded at ep4, ep2, ep1; experts saved at ep1 (grouped
    GEMM where the release builds it) loaded into SequentialMLP at ep4."""
    last = (("grouped GEMM at ep1 -> SequentialMLP at ep4", 1, True, False, (4,)) if has_grouped_mlp()
            else ("SequentialMLP at ep1 -> ep4", 1, False, False, (4,)))
    return [("SequentialMLP at ep4", 4, False, False, (4, 2, 1)), last]


def moe_paths(rank, world, tokenizer_dir, root, cases=None) -> dict:
    """{case: {ep it loads in: max logit difference from the live model}} for each (name, saved ep, grouped GEMM,
    singleton_local_shards, eps to load in) of `cases` (default: moe_cases())."""
    from nano_eval.checkpoints.megatron_native import load_native
    from tests.megatron_gpt import GPTConfig
    from tests.megatron_moe import moe_args
    from tests.megatron_worker import _setup

    root = Path(root)
    ids = torch.randint(0, GPTConfig().vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    out = {}
    for case, ep, grouped, singleton, load_eps in cases or moe_cases():
        _setup(1, ep=ep)
        model = _moe_model(grouped)
        # GroupedMLP asserts config.bf16 at every forward (its CUDA kernel's only dtype); the double computes in fp32,
        # so the flag is raised around the live forward alone (built fp32, nothing else reads it here)
        model.config.bf16 = grouped
        live = _live_logits(model, ids)
        model.config.bf16 = False
        args = moe_args(ep=ep, dispatcher="alltoall")
        args.moe_grouped_gemm = grouped
        run = root / f"moe{len(out)}"
        _save(model, None, args, run, {"singleton_local_shards": singleton, "chained_optim_avoid_prefix": True})
        out[case] = {}
        for load_ep in load_eps:
            try:
                backend = load_native(str(run), str(tokenizer_dir), tp=1, pp=1, ep=load_ep, dtype="float32",
                                      max_length=None, device="cpu")
                out[case][f"ep{load_ep}"] = (_live_logits(backend.chunks[0], ids) - live).abs().max().item()
            except Exception as e:  # noqa: BLE001 -- the test expects none
                out[case][f"ep{load_ep}"] = f"{type(e).__name__}: {e}"[:400]
    return out


def all_paths(rank, world, tokenizer_dir, root) -> dict:
    """The one world of tests/test_megatron_native_paths.py: the dense cases, then the MoE ones."""
    return {**native_paths(rank, world, tokenizer_dir, root), **moe_paths(rank, world, tokenizer_dir, root)}


def ep4_paths(rank, world, tokenizer_dir, root) -> dict:
    """The slow set's world of 4: ep4 -> ep2 -> ep1, and grouped GEMM at ep1 -> ep4."""
    return moe_paths(rank, world, tokenizer_dir, root, ep4_cases())
