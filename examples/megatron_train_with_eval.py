"""Train a megatron-core GPTModel the way Megatron-LM's pretrain does, with nano_eval as its non_loss_data_func.

    torchrun --nproc_per_node=2 examples/megatron_train_with_eval.py                # pp2 (1F1B schedule)
    torchrun --nproc_per_node=4 examples/megatron_train_with_eval.py --tp 2 --pp 2  # tp2 x pp2

What it shows, in the order Megatron-LM's `train()` / `evaluate()` do it:
- megatron-core's DistributedDataParallel + `get_megatron_optimizer` (distributed optimizer) and its pipeline
  schedule train a Llama-style GPTModel (RoPE, GQA, SwiGLU, RMSNorm) on arithmetic lines;
- `args.curr_iteration = iteration` before each step, `iteration += 1` after; every --eval-interval iterations
  `evaluate()` runs the validation loss through the schedule and then calls `non_loss_data_func(model)` on every
  rank; after training, the validation set and then the test set are evaluated at the last iteration (nano_eval
  scores that iteration once and returns the same results the second time);
- W&B (offline here) lives on the last rank, as Megatron-LM's writer does, and every row is logged at
  `step=iteration`; nano_eval publishes from that rank into that run;
- at the end (and every --save-interval iterations) `save_checkpoint` writes Megatron-LM's legacy checkpoint
  (`--ckpt-format torch --no-save-optim --no-save-rng`), which `nano_eval --checkpoint` scores like the live model.
Megatron-LM's own `pretrain(..., non_loss_data_func=hook)` does all of this for you; this script spells it out
with megatron-core alone so that it runs anywhere. Without a GPU it runs on CPU/gloo through the test double
tests/megatron_cpu.py (megatron-core has a few CUDA-only calls); with GPUs it uses nccl and nothing is patched.
Outputs: <output-dir>/eval_results.jsonl (one line per evaluated iteration), <output-dir>/step_<N>/results.json,
<output-dir>/checkpoints/iter_<N:07d>/ (+ latest_checkpointed_iteration.txt), <output-dir>/tokenizer/.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import warnings
from argparse import Namespace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"


def parse_args() -> Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=60)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--save-interval", type=int, default=0, help="also checkpoint every N iterations (0: at the end)")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--max-samples", type=int, default=40, help="documents per task and evaluation")
    p.add_argument("--output-dir", default="megatron_train_with_eval_out")
    p.add_argument("--wandb-mode", default="offline", choices=["offline", "online", "disabled"])
    return p.parse_args()


def build_model(args, vocab_size: int) -> list:
    """This rank's GPTModel chunk (local layer spec, so no Transformer Engine is needed)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, hidden_dropout=0.1, attention_dropout=0.0, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, init_method_std=0.02,
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    vocab = -(-vocab_size // (128 * args.tp)) * 128 * args.tp  # padded as Megatron-LM pads it
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=vocab, max_sequence_length=args.seq_length, position_embedding_type="rope",
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                     share_embeddings_and_output_weights=False, parallel_output=True)
    return [model.cuda() if torch.cuda.is_available() else model]


def save_checkpoint(model, margs: Namespace, root: Path, iteration: int) -> None:
    """Megatron-LM's legacy save (no optimizer, no RNG state): the first DP replica of every TP x PP rank writes
    root/iter_%07d/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt = {args, checkpoint_version, iteration, model};
    then rank 0 writes the tracker root/latest_checkpointed_iteration.txt. Each file is written whole, then renamed."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    path = root / f"iter_{iteration:07d}" / name / "model_optim_rng.pt"
    if ps.get_data_parallel_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        margs.iteration = iteration
        torch.save({"args": margs, "checkpoint_version": 3.0, "iteration": iteration,
                    "model": model[0].state_dict_for_save_checkpoint()}, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    dist.barrier()
    if dist.get_rank() == 0:
        tracker = root / "latest_checkpointed_iteration.txt"
        tracker.with_suffix(".tmp").write_text(str(iteration))
        os.replace(tracker.with_suffix(".tmp"), tracker)
    dist.barrier()


def batches(tokenizer, seed: int, n: int, seq: int, device) -> list:
    """n microbatch rows [1, seq + 1] of arithmetic lines (padded with EOS), as (tokens, labels, loss_mask)."""
    from nano_eval.toy import arithmetic_line

    rng, rows = random.Random(seed), []
    for _ in range(n):
        text = "\n\n".join(arithmetic_line(rng.randrange(10), rng.randrange(10)) for _ in range(8))
        ids = tokenizer(text).input_ids[:seq + 1]
        mask = [1.0] * (len(ids) - 1) + [0.0] * (seq + 1 - len(ids))
        ids = ids + [tokenizer.eos_token_id] * (seq + 1 - len(ids))
        t = torch.tensor([ids], device=device)
        rows.append((t[:, :-1], t[:, 1:], torch.tensor([mask], device=device)))
    return rows


def forward_step(data_iterator, model):
    """Megatron-LM's forward_step_func: (output tensor, loss function) for one microbatch."""
    tokens, labels, mask = next(data_iterator)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    output = model(tokens, positions, None, labels=labels)  # per-token loss on the last stage

    def loss_func(losses, non_loss_data=False):
        loss = (losses.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", module="megatron")  # "Apex is not installed", ...
    os.environ.setdefault("WANDB_SILENT", "true")
    cuda = torch.cuda.is_available()
    if not cuda:  # megatron-core on a CPU-only torch: answer its CUDA-only calls (a test double, see its docstring)
        from tests import megatron_cpu

        megatron_cpu.install()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from nano_eval.toy import build_tokenizer
    from nano_eval.tracking.jsonl import read_jsonl
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.megatron import make_non_loss_data_func

    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp)
    rank, world, device = dist.get_rank(), dist.get_world_size(), "cuda" if cuda else "cpu"
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    out = Path(args.output_dir)

    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    model = build_model(args, len(tokenizer))
    config = model[0].config
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), m)
             for m in model]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0,
                                                       use_distributed_optimizer=True, params_dtype=torch.float32),
                                       model)
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, model[0].no_sync
    schedule = get_forward_backward_func()
    n_micro = args.global_batch_size // (args.micro_batch_size * dp)

    # Megatron-LM's args (megatron.training.get_args): the fields train() maintains and the hook reads, and the
    # model's description that save_checkpoint pickles with the weights (Megatron-LM's argument names)
    margs = Namespace(iteration=0, curr_iteration=0, consumed_train_samples=0, seq_length=args.seq_length,
                      global_batch_size=args.global_batch_size, micro_batch_size=args.micro_batch_size,
                      skip_train=False, num_layers=config.num_layers, hidden_size=config.hidden_size,
                      ffn_hidden_size=config.ffn_hidden_size, num_attention_heads=config.num_attention_heads,
                      group_query_attention=True, num_query_groups=config.num_query_groups,
                      kv_channels=config.kv_channels, max_position_embeddings=args.seq_length,
                      padded_vocab_size=model[0].module.vocab_size, normalization="RMSNorm",
                      norm_epsilon=config.layernorm_epsilon, swiglu=True, position_embedding_type="rope",
                      rotary_base=10000, rotary_percent=1.0, rotary_interleaved=False,
                      untie_embeddings_and_output_weights=True, add_bias_linear=False, add_qkv_bias=False,
                      qk_layernorm=False, tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                      params_dtype=torch.float32, ckpt_format="torch")
    wandb_writer = None
    if rank == world - 1 and args.wandb_mode != "disabled":  # Megatron-LM's _set_wandb_writer: the last rank
        try:
            import wandb

            out.mkdir(parents=True, exist_ok=True)
            wandb_writer = wandb.init(project="nano_eval_megatron_example", dir=str(out.resolve()),
                                      mode=args.wandb_mode, config=vars(args))
        except Exception as e:  # the example still runs without W&B
            print(f"W&B unavailable ({type(e).__name__}: {e}); continuing without it", file=sys.stderr)
    hook = make_non_loss_data_func(EvalHookConfig(tasks=TASKS, max_samples=args.max_samples, output_dir=out),
                                   tokenizer, get_args=lambda: margs, micro_batch_size=args.micro_batch_size)

    def run_schedule(seed: int, forward_only: bool) -> list[float]:
        rows = batches(tokenizer, seed * 1000 + dp_rank, n_micro * args.micro_batch_size, args.seq_length, device)
        micro = [tuple(torch.cat(parts) for parts in zip(*rows[i:i + args.micro_batch_size]))
                 for i in range(0, len(rows), args.micro_batch_size)]
        losses = schedule(forward_step_func=forward_step, data_iterator=iter(micro), model=model,
                          num_microbatches=n_micro, seq_length=args.seq_length,
                          micro_batch_size=args.micro_batch_size, forward_only=forward_only)
        return [d["lm loss"].item() for d in losses]  # [] off the last stage

    def evaluate(iteration: int, name: str, seed: int) -> None:
        """Megatron-LM's evaluate() + evaluate_and_print_results(): loss, then non_loss_data_func on every rank."""
        for m in model:
            m.eval()
        with torch.no_grad():
            losses = run_schedule(seed, forward_only=True)
            hook(model)
        for m in model:
            m.train()
        if wandb_writer is not None and losses:
            wandb_writer.log({f"lm loss {name}": sum(losses) / len(losses)}, iteration)

    iteration = 0
    for m in model:
        m.train()
    while iteration < args.train_iters:
        margs.curr_iteration = iteration
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        losses = run_schedule(iteration, forward_only=False)
        optimizer.step()
        iteration += 1
        margs.consumed_train_samples += args.global_batch_size
        if wandb_writer is not None and losses:
            wandb_writer.log({"lm loss": sum(losses) / len(losses)}, iteration)
        if iteration % args.eval_interval == 0:
            evaluate(iteration, "validation", seed=-1)
        if args.save_interval and iteration % args.save_interval == 0 and iteration < args.train_iters:
            save_checkpoint(model, margs, out / "checkpoints", iteration)
    save_checkpoint(model, margs, out / "checkpoints", iteration)  # as pretrain() saves after training
    if rank == 0:
        tokenizer.save_pretrained(out / "tokenizer")  # Megatron stores none; nano_eval --checkpoint needs one
    evaluate(iteration, "validation", seed=-1)  # after training: validation set, then test set
    evaluate(iteration, "test", seed=-2)
    hook.close()
    if wandb_writer is not None:
        wandb_writer.finish()

    if rank == world - 1:  # the rank that published
        print(f"trained {iteration} iterations at tp={args.tp} pp={args.pp} dp={dp}; from {out}/eval_results.jsonl:")
        for row in read_jsonl(out / "eval_results.jsonl"):
            acc = row["results"]["demo|arithmetic|0"]["acc"]
            bpb = row["results"]["demo|arithmetic_ppl|0"]["bits_per_byte"]
            print(f"  iteration {row['step']:>4}  tokens {row['consumed_tokens']:>7}  arithmetic acc {acc:.3f}  "
                  f"arithmetic_ppl bits/byte {bpb:.3f}")
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
