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

    from nano_eval.models.megatron_model import MegatronModel
    from nano_eval.toy_megatron import ToyConfig, build_toy_megatron_model

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
    from nano_eval.requests import LoglikelihoodRequest

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

    from nano_eval.toy_megatron import megatron_args

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
    from nano_eval.integrations.megatron_pretrain import make_non_loss_data_func
    from nano_eval.hook import EvalHookConfig

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
