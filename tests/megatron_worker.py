"""Code that runs inside each spawned rank of the Megatron tests (real megatron-core layers on gloo)."""

import warnings
from pathlib import Path

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|0"


def _setup(tp: int):
    warnings.filterwarnings("ignore", module="megatron")  # "Transformer Engine and Apex are not installed", ...
    from nano_eval.compat.megatron import initialize_cpu_model_parallel

    initialize_cpu_model_parallel(tp=tp)


def _backend(tokenizer_dir, seed=0):
    from transformers import AutoTokenizer

    from nano_eval.backends.megatron import MegatronModel
    from tests.toy_megatron import ToyConfig, build_toy_megatron_model

    cfg = ToyConfig()
    model = build_toy_megatron_model(cfg, seed=seed)
    return MegatronModel(model, AutoTokenizer.from_pretrained(tokenizer_dir), max_length=cfg.max_position_embeddings)


def evaluate_layout(rank, world, tp, tokenizer_dir, batch_tokens=4096, max_samples=12):
    """The toy Megatron model at tp x (world / tp) scored on TASKS; returns a summary per task."""
    from tests.nanotron_worker import summarize  # backend-agnostic (imports no nanotron)

    _setup(tp)
    return summarize(_backend(tokenizer_dir), TASKS, batch_tokens, max_samples)


def tp2_checks(rank, world, tokenizer_dir, ckpt_root, hook_dir, iteration=100):
    """Everything the TP2 world checks, in one spawn: scores, vocab_parallel_cross_entropy agreement, the legacy
    checkpoint written as Megatron writes it, and the pretrain hook."""
    import torch.distributed as dist

    from tests.nanotron_worker import summarize

    _setup(2)
    backend = _backend(tokenizer_dir)
    out = {"layout": backend.layout.describe(), "scores": summarize(backend, TASKS, 96, 12)}
    out["cross_entropy"] = cross_entropy_agreement(backend)
    save_legacy_checkpoint(backend.module[0], Path(ckpt_root), iteration)
    dist.barrier()
    out["hook"] = run_hook(backend.module[0], backend.tokenizer, hook_dir)
    return out


def cross_entropy_agreement(backend) -> float:
    """Largest |engine log-prob - (-sum of vocab_parallel_cross_entropy)| over a few requests, where the engine
    goes through MegatronModel + the scoring core and the reference through Megatron's own loss."""
    import torch
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from nano_eval.engine import Engine
    from nano_eval.tasks.requests import LoglikelihoodRequest

    engine = Engine(backend, progress=False)
    pairs = [("Question: 3 plus 4\nAnswer:", " 7"), ("The dog runs", " to the big house."), ("", "Yes no true")]
    requests = [LoglikelihoodRequest("t", i, 0, c, choice=x) for i, (c, x) in enumerate(pairs)]
    results = engine.run_loglikelihood(engine.prepare_loglikelihood(requests))
    worst = 0.0
    for r in requests:
        ctx, cont = engine.encode_pair(r.context, r.choice)
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logits = backend.module[0](*backend._inputs(ids[:, :-1]))  # [1, S, V/tp]
            ce = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), ids[:, 1:].T.contiguous())
        reference = -ce[len(ctx) - 1:].sum().item()
        worst = max(worst, abs(results[r.key].logprob - reference))
    return worst


def save_legacy_checkpoint(model, root: Path, iteration: int):
    """Megatron's legacy layout: each TP rank writes iter_%07d/mp_rank_%02d/model_optim_rng.pt with `model`, `args`,
    `iteration`, `checkpoint_version` and an RNG state (numpy arrays inside); rank 0 writes the tracker file."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnBackend

    from tests.toy_megatron import megatron_args

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    args = megatron_args(model.cfg, tp=tp)
    args.attention_backend, args.save = AttnBackend.auto, root  # an enum and a path, as real args hold
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state()}
    path = root / f"iter_{iteration:07d}" / f"mp_rank_{rank:02d}" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    if ps.get_data_parallel_rank() == 0:
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": model.state_dict(),
                    "rng_state": [rng]}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def run_hook(model, tokenizer, out_dir):
    """The pretrain hook called the way Megatron's evaluate() calls it: non_loss_data_func([model chunks])."""
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.megatron import make_non_loss_data_func

    config = EvalHookConfig(tasks="demo|arithmetic|0", max_samples=12, output_dir=out_dir, wandb=False)
    step = {"value": 300}
    hook = make_non_loss_data_func(config, tokenizer, get_iteration=lambda: step["value"], tokens_per_iteration=1024)
    model.train()  # Megatron hands over an eval-mode model; the hook must restore whatever it gets
    first = hook([model])
    step["value"] = 400
    second = hook([model])
    hook.close()
    return {"steps": [first.step, second.step], "tokens": [first.consumed_tokens, second.consumed_tokens],
            "metrics": [first.tasks["demo|arithmetic|0"].metrics, second.tasks["demo|arithmetic|0"].metrics],
            "training_restored": model.training and all(m.training for m in model.modules())}


def cpu_torch_dist_strategy():
    """megatron-core's torch_dist save strategy, writing with torch's synchronous FileSystemWriter.

    Not a mock: the state-dict translation, the planner and the file format are megatron-core's and
    torch.distributed.checkpoint's own. Only the writer differs: megatron-core 0.16's async writer calls
    torch.cuda.synchronize() / torch.cuda.current_device(), so `dist_checkpointing.save` fails on a CPU build."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)

    class CpuTorchDistSave(TorchDistSaveShardedStrategy):
        def save(self, sharded_state_dict, checkpoint_dir):
            state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, self.keep_only_main_replica)
            dcp.save(mcore_to_pyt_state_dict(state, False), storage_writer=dcp.FileSystemWriter(checkpoint_dir),
                     planner=MCoreSavePlanner(can_run_decentralized_global_plan=False, flatten_state_dict=False))

    return CpuTorchDistSave("torch_dist", 1)


def toy_gpt_model(args):
    """A real megatron-core GPTModel (local spec, CPU) on this rank's TP shard and PP stage, holding the seed-0 toy
    weights (with tied embeddings, the toy's lm_head is not used)."""
    import re

    from megatron.core import parallel_state as ps

    from nano_eval.checkpoints.megatron_dist import build_gpt_model
    from tests.toy_megatron import ToyConfig, logical_weights, megatron_shard

    cfg, pp = ToyConfig(), ps.get_pipeline_model_parallel_world_size()
    first = ps.get_pipeline_model_parallel_rank() * cfg.num_layers // pp
    local_names = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                   "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}

    def local(name):  # TE norm names -> local spec's; global layer numbers -> this stage's
        name = next((name.replace(te, loc) for te, loc in local_names.items() if name.endswith(te)), name)
        return re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) - first}.", name)

    model = build_gpt_model(vars(args))
    own = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    shard = megatron_shard(logical_weights(cfg), cfg, ps.get_tensor_model_parallel_rank(),
                           ps.get_tensor_model_parallel_world_size())
    state = {local(k): v for k, v in shard.items() if local(k) in own}
    assert set(state) == own, sorted(own - set(state))
    model.load_state_dict(state, strict=False)
    return model


def save_dist_checkpoint(model, args, root: Path, iteration: int):
    """What Megatron-LM's save_checkpoint writes for --ckpt-format torch_dist (--no-save-optim): one
    dist_checkpointing.save of {args, checkpoint_version, iteration, model (sharded), rng_state (a ShardedObject per
    TP x PP rank), num_floating_point_operations_so_far} with its content metadata; rank 0 writes the tracker."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing import ShardedObject

    metadata = {"singleton_local_shards": False}  # Megatron-LM's _build_sharded_state_dict_metadata without DistOpt
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state()}
    tp_rank, tp = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    pp_rank, pp = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": model.sharded_state_dict(
                 metadata={**metadata, "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}),
             "rng_state": ShardedObject("rng_state", [rng], (pp, tp), (pp_rank, tp_rank),
                                        replica_id=ps.get_data_parallel_rank()),
             "num_floating_point_operations_so_far": 0}
    iter_dir = root / f"iter_{iteration:07d}"
    iter_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(state, str(iter_dir), cpu_torch_dist_strategy(), content_metadata=metadata)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def state_digest(state: dict) -> str:
    """sha256 over the names and bytes of a state dict: equal digests = identical tensors in identical places."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode() + state[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def dist_checkpoint_checks(rank, world, root, iteration=100):
    """TP2 world: write the toy model as a legacy and a torch_dist checkpoint (as Megatron-LM does), then load the
    torch_dist one on both ranks of this world (what run.py under torchrun does). Returns the loaded weights'
    fingerprint and the process-group state after the load."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf
    from tests.toy_megatron import ToyConfig, build_toy_megatron_model, megatron_args

    _setup(2)
    root = Path(root)
    save_legacy_checkpoint(build_toy_megatron_model(ToyConfig()), root / "legacy", iteration)
    from megatron.core.transformer.enums import AttnBackend

    args = megatron_args(ToyConfig(), tp=2)
    args.ckpt_format, args.attention_backend, args.save = "torch_dist", AttnBackend.auto, root / "dist"  # as real args
    save_dist_checkpoint(toy_gpt_model(args), args, root / "dist", iteration)
    ps.destroy_model_parallel()
    hf = load_megatron_llama_as_hf(root / "dist" / f"iter_{iteration:07d}")
    return {"digest": state_digest(hf.state_dict()),
            "parallel_state_clean": not ps.model_parallel_is_initialized(), "world": dist.get_world_size()}


def save_dist_layout(rank, world, root, tp, pp, untie=True, iteration=100):
    """The toy model saved as torch_dist at tp x pp (world = tp x pp) with tied or untied embeddings."""
    from nano_eval.compat.megatron import initialize_cpu_model_parallel
    from tests.toy_megatron import ToyConfig, megatron_args

    warnings.filterwarnings("ignore", module="megatron")
    initialize_cpu_model_parallel(tp=tp, pp=pp)
    args = megatron_args(ToyConfig(), tp=tp, pp=pp)
    args.ckpt_format, args.untie_embeddings_and_output_weights = "torch_dist", untie
    save_dist_checkpoint(toy_gpt_model(args), args, Path(root), iteration)
