"""Code that runs inside spawned ranks of tests/test_nanotron_main.py: nanotron MAIN's REAL Qwen2ForTraining and
DistributedTrainer on CPU/gloo (tests/nanotron_main_cpu.py installs the CPU setup in each rank).

Tiny Qwen2 (hidden 64, 4 layers, 4 heads / 2 kv heads, vocab 544 >= the toy tokenizer's 537 tokens) in the variants
nanotron main offers: dense, no-RoPE layers (SmolLM3's `no_rope_layer: 4`: layer 4 skips RoPE), qkv bias, sliding
window, MoE (4 experts, top 2, shared expert). Configs are written with nanotron main's own Config classes and
`save_as_yaml`, checkpoints with its own init_model_randomly / save_weights.
"""

from __future__ import annotations

import os
from pathlib import Path

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, SEQ = 544, 64, 4, 4, 2, 128, 32
VARIANTS = {
    "dense": {},
    "nope": {"no_rope_layer": 4},
    "bias": {"attention_bias": True},
    "swa": {"sliding_window_size": 6},
    "nope_swa": {"no_rope_layer": 2, "sliding_window_size": 6},  # nanotron drops the window in no-RoPE layers
    "moe": {"moe_config": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32,
                           "shared_expert_intermediate_size": 64, "enable_shared_expert": True}},
}
TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|0"


def setup(fix_pp: bool = False) -> None:
    import torch

    from tests.nanotron_main_cpu import install

    torch.set_num_threads(1)
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))  # main's ParallelContext asserts it (torchrun sets it)
    os.environ.setdefault("WANDB_MODE", "disabled")
    install(fix_pp=fix_pp)


def qwen2_config(variant: str):
    from nanotron.config.models_config import MoEConfig, Qwen2Config

    extra = dict(VARIANTS[variant])
    if "moe_config" in extra:
        extra["moe_config"] = MoEConfig(**extra["moe_config"])
    return Qwen2Config(
        bos_token_id=1, eos_token_id=2, hidden_act="silu", hidden_size=HIDDEN, intermediate_size=FFN,
        max_position_embeddings=SEQ * 2, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
        num_key_value_heads=KV_HEADS, rms_norm_eps=1e-6, rope_theta=10000.0, rope_interleaved=False,
        tie_word_embeddings=True, vocab_size=VOCAB, _attn_implementation="flash_attention_2", _use_doc_masking=True,
        log_attn_probs=False, **extra)


def write_config(path: str, tokenizer_dir: str, run_dir: str, variant: str = "dense", *, tp=1, pp=1, dp=1,
                 steps: int = 4, save_every: int = 3, nano_eval: dict | None = None) -> str:
    """A nanotron main training YAML (nanotron's own Config and save_as_yaml), dummy data, fp32, AdamW; with
    `nano_eval`, that section appended."""
    import torch
    import yaml
    from nanotron.config import (AdamWOptimizerArgs, CheckpointsArgs, Config, DataArgs, DatasetStageArgs,
                                 GeneralArgs, LoggingArgs, LRSchedulerArgs, ModelArgs, OptimizerArgs,
                                 ParallelismArgs, RandomInit, TokenizerArgs, TokensArgs)

    run = Path(run_dir).resolve()
    config = Config(
        general=GeneralArgs(project="nano_eval_tests", run=f"qwen2_{variant}", seed=42),
        parallelism=ParallelismArgs(dp=dp, pp=pp, tp=tp, pp_engine="1f1b", tp_mode="ALL_REDUCE",
                                    tp_linear_async_communication=False),
        model=ModelArgs(model_config=qwen2_config(variant), init_method=RandomInit(std=0.15), dtype=torch.float32),
        tokenizer=TokenizerArgs(tokenizer_name_or_path=str(tokenizer_dir)),
        checkpoints=CheckpointsArgs(checkpoints_path=run / "checkpoints", checkpoint_interval=save_every,
                                    save_final_state=False),
        logging=LoggingArgs(log_level="info", log_level_replica="info", iteration_step_info_interval=1),
        tokens=TokensArgs(sequence_length=SEQ, train_steps=steps, micro_batch_size=2, batch_accumulation_per_replica=1),
        optimizer=OptimizerArgs(
            optimizer_factory=AdamWOptimizerArgs(adam_eps=1e-8, adam_beta1=0.9, adam_beta2=0.95,
                                                 torch_adam_is_fused=False),
            zero_stage=0, weight_decay=0.0, clip_grad=1.0, accumulate_grad_in_fp32=False,
            learning_rate_scheduler=LRSchedulerArgs(learning_rate=3e-3, lr_warmup_steps=1, lr_warmup_style="linear",
                                                    lr_decay_style="cosine", min_decay_lr=3e-4)),
        data_stages=[DatasetStageArgs(name="dummy", start_training_step=1,
                                      data=DataArgs(dataset=None, seed=42, num_loading_workers=0))],
    )
    config.save_as_yaml(str(path))
    if nano_eval is not None:
        text = yaml.safe_load(Path(path).read_text())
        text["nano_eval"] = nano_eval
        Path(path).write_text(yaml.safe_dump(text, sort_keys=False))
    return str(path)


def parallel_context(tp: int, pp: int, dp: int, cp: int = 1):
    from nanotron.parallel import ParallelContext

    return ParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                           context_parallel_size=cp)


def build_qwen2(pc, model_config, tp_mode: str = "ALL_REDUCE"):
    """nanotron main's Qwen2ForTraining in `pc`'s layout (build_model, fp32, cpu)."""
    import torch
    from nanotron.config import ParallelismArgs
    from nanotron.models import build_model
    from nanotron.models.qwen import Qwen2ForTraining
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
    from nanotron.trainer import mark_tied_parameters

    parallel = ParallelismArgs(dp=pc.dp_pg.size(), pp=pc.pp_pg.size(), tp=pc.tp_pg.size(),
                               context_parallel_size=pc.cp_pg.size(), tp_mode=TensorParallelLinearMode[tp_mode],
                               tp_linear_async_communication=False)
    model = build_model(
        model_builder=lambda: Qwen2ForTraining(config=model_config, parallel_context=pc, parallel_config=parallel,
                                               random_states=None),
        parallel_context=pc, dtype=torch.float32, device=torch.device("cpu"))
    mark_tied_parameters(model=model, parallel_context=pc, parallel_config=parallel)
    return model


def make_checkpoint(rank, world, config_path: str, ckpt_dir: str, seed: int = 0) -> None:
    """nanotron main's init_model_randomly (tp1, seeded) + save_weights, its checkpoint metadata and config.yaml,
    as its trainer saves them (dp = world)."""
    import shutil

    import torch
    import torch.distributed as dist
    from nanotron.serialize import save_weights
    from nanotron.serialize.metadata import TrainingMetadata, save_meta

    from nano_eval.training.nanotron import load_config

    config = load_config(config_path)
    pc = parallel_context(1, 1, world)
    model = build_qwen2(pc, config.model.model_config)
    torch.manual_seed(seed)
    model.init_model_randomly(config=config)
    save_weights(model, pc, Path(ckpt_dir))
    meta = TrainingMetadata(consumed_train_samples=0, last_train_step=0, last_stage_idx=0, data_stages=[],
                            consumed_tokens_total=0)
    save_meta(pc, Path(ckpt_dir), meta)
    if rank == 0:
        shutil.copy(config_path, Path(ckpt_dir) / "config.yaml")
    dist.barrier()


def rows_batch(tokens: list[list[int]]):
    """A right-padded Batch scoring every position of each row (rows of different lengths)."""
    import torch

    from nano_eval.backends.base import Batch

    width = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    rows, cols = [], []
    for r, t in enumerate(tokens):
        ids[r, :len(t)] = torch.tensor(t)
        mask[r, :len(t)] = 1
        rows += [r] * len(t)
        cols += list(range(len(t)))
    return Batch(input_ids=ids, attention_mask=mask, rows=torch.tensor(rows), cols=torch.tensor(cols),
                 targets=torch.full((len(rows),), -1))


def own_forward_logits(model, tokens: list[list[int]], first: int, last: int, multiple: int = 1):
    """The model's own forward on each row ALONE (no padding, positions 0..len-1, as nanotron's collator gives a
    one-document row): [sum(len), V/tp] on the last stage, None elsewhere. `multiple`: sequence-parallel TP needs
    the tokens to divide by tp, so rows get that many trailing tokens at most (after the compared ones)."""
    import torch
    import torch.distributed as dist
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    out = []
    pp_rank = dist.get_rank(model.parallel_context.pp_pg)
    with torch.no_grad():
        for t in tokens:
            if pp_rank == first:
                ids = torch.tensor([t + [0] * (-len(t) % multiple)])
                pos = torch.arange(ids.shape[1]).unsqueeze(0)
            else:
                ids = pos = TensorPointer(group_rank=first)
            logits = model.model(input_ids=ids, position_ids=pos)
            if pp_rank == last:
                out.append(logits[:len(t)])
    return torch.cat(out) if out else None


def backend_vs_model(ckpt_dirs: dict, layouts: list, score: tuple = ()) -> dict:
    """For each variant's checkpoint and each (name, tp, pp[, tp_mode]): the model built as `run.py --backend
    nanotron` builds it (load_native); the backend's logits on a batch of rows of 3..20 tokens (right-padded) vs
    the model's own forward on each row alone. Returns {(variant, layout): max |diff|} on the last stage's ranks,
    or the text of the NanoEvalError every rank raised; and {(variant, layout, "scores"): summary} for the
    (variant, layout) pairs in `score`."""
    import torch

    from nano_eval.checkpoints.nanotron import load_native
    from nano_eval.errors import NanoEvalError
    from tests.nanotron_worker import packing_checks, summarize

    g = torch.Generator().manual_seed(7)
    tokens = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (3, 20, 11, 7)]
    out = {}
    for variant, ckpt in ckpt_dirs.items():
        for name, tp, pp, *mode in layouts:
            try:
                backend = load_native(ckpt, None, tp=tp, pp=pp, dtype="float32", max_length=None,
                                      tp_mode=(mode or ["ALL_REDUCE"])[0])
            except NanoEvalError as e:
                out[(variant, name)] = f"NanoEvalError: {e}"
                continue
            got = backend.forward(rows_batch(tokens))
            want = own_forward_logits(backend.module, tokens, backend.layout.input_pp_rank,
                                      backend.layout.output_pp_rank, backend.seq_multiple)
            if got is not None:
                out[(variant, name)] = (got - want).abs().max().item()
            out[(variant, name, "packing")] = packing_checks(backend)  # packed rows vs one row per request
            if (variant, name) in score:
                out[(variant, name, "scores")] = summarize(backend, TASKS, 256, 6)
    return out


def main_world(rank, world, root: str, tokenizer_dir: str, slow: bool) -> dict:
    """Everything tests/test_nanotron_main.py checks, in ONE world of 2 ranks (imports cost more than the checks):
    configs, checkpoints of every variant (nanotron's init + save_weights), the backend in several layouts, the
    training runs with and without evaluation, and (after the upstream pp fixes are installed) the pp2 layouts.
    `slow`: also pp2 training and more layouts."""
    import time

    import torch.distributed as dist

    start = time.monotonic()
    setup()
    times = {"setup": time.monotonic() - start}
    root_dir = Path(root)
    variants = ["dense", "nope", "bias", "swa", "nope_swa", "moe"]
    if rank == 0:
        for v in variants:
            write_config(str(root_dir / f"{v}.yaml"), tokenizer_dir, str(root_dir / v), v)
    dist.barrier()
    ckpts = {v: str(root_dir / f"ckpt_{v}") for v in variants}
    for v in variants:
        make_checkpoint(rank, world, str(root_dir / f"{v}.yaml"), ckpts[v])
    out = {"ckpts": ckpts, "times": times}
    times["checkpoints"] = time.monotonic() - start
    layouts = [("tp2", 2, 1)] + ([("tp1xdp2", 1, 1), ("tp2-reduce_scatter", 2, 1, "REDUCE_SCATTER")] if slow else [])
    out["backend"] = backend_vs_model(ckpts, layouts, score=tuple((v, "tp2") for v in variants))
    out["backend"] |= backend_vs_model({"dense": ckpts["dense"]}, [("tp1xdp2", 1, 1)] if not slow else [])
    # nano_eval's Qwen2 KV cache: its logits vs the scoring forward, its greedy generations vs the re-run path's
    out["cache"] = cache_vs_scoring(ckpts, [("tp2", 2, 1)])
    out["cache"] |= cache_vs_scoring({v: ckpts[v] for v in ("dense", "bias")}, [("tp1xdp2", 1, 1)])
    out["generation"] = generation_vs_rerun({v: ckpts[v] for v in ("dense", "nope", "bias", "swa", "moe")},
                                            [("tp2", 2, 1)])
    out["generation"] |= generation_vs_rerun({"nope_swa": ckpts["nope_swa"]}, [("tp1xdp2", 1, 1)])
    bf16 = {v: ckpts[v] for v in ("dense", "moe")}
    out["cache"] |= cache_vs_scoring(bf16, [("tp2-bf16", 2, 1, "bfloat16")])
    out["generation"] |= generation_vs_rerun(bf16, [("tp2-bf16", 2, 1, "bfloat16")])
    times["cache"] = time.monotonic() - start
    out["cp2"] = cp_folded_into_dp(ckpts["dense"])
    times["cp2"] = time.monotonic() - start
    # pp2 on nanotron main as released: refused on both ranks before any forward (no rank left in a P2P receive)
    out["pp2_unfixed"] = backend_vs_model({"dense": ckpts["dense"]}, [("pp2", 1, 2)])
    times["backend"] = time.monotonic() - start

    training = [("dense", "tp2", dict(tp=2)), ("nope", "dp2", dict(dp=2))]
    if slow:
        training += [("moe", "tp2", dict(tp=2)), ("bias", "dp2", dict(dp=2)), ("swa", "tp2", dict(tp=2))]
    out["training"] = train_layouts(rank, root_dir, tokenizer_dir, training)
    times["training"] = time.monotonic() - start
    # the live step-3 scores of the no-RoPE run, against --backend nanotron on its step-3 checkpoint (tp2)
    nope_run = root_dir / "train_nope_dp2_with"
    out["nope_step3_native"] = backend_vs_model({"nope": str(nope_run / "checkpoints" / "3")}, [("tp2", 2, 1)],
                                                score=(("nope", "tp2"),))

    install_pp_fix()
    out["pp2"] = backend_vs_model({v: ckpts[v] for v in (variants if slow else ["dense", "nope"])}, [("pp2", 1, 2)],
                                  score=(("nope", "pp2"),))
    out["cache"] |= cache_vs_scoring({v: ckpts[v] for v in ("dense", "nope")}, [("pp2", 1, 2)])
    out["generation"] |= generation_vs_rerun({"nope": ckpts["nope"]}, [("pp2", 1, 2)])
    if slow:
        out["training"] |= train_layouts(rank, root_dir, tokenizer_dir, [("nope", "pp2", dict(pp=2))])
    times["end"] = time.monotonic() - start
    return out


def cp_folded_into_dp(ckpt: str) -> dict:
    """The dense checkpoint in a cp2 world (tp1, dp1; nanotron main's llama3 ring attention, as its CP training runs
    it): nano_eval's backend on the live model, with CP folded into DP. Returns the scores, the layout, max |diff|
    between the backend's logits of one 32-token row and the ring forward's (each CP rank computes half the row,
    gathered), and whether a training-mode ring forward + backward (micro-batch 1, global positions, the layout
    nanotron main's CP is exact in) is bitwise the same after the evaluation as before it, plus the attributes the
    backend switches, read back after it."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from nanotron.serialize import load_weights
    from transformers import AutoTokenizer

    from nano_eval.backends.nanotron import NanotronModel
    from nano_eval.checkpoints.nanotron import tokenizer_path
    from nano_eval.training.nanotron import load_config
    from tests.generation_checks import cached_and_rerun
    from tests.nanotron_worker import packing_checks, summarize

    config = load_config(str(Path(ckpt) / "config.yaml")).model.model_config
    config = dataclasses.replace(config, _attn_implementation="llama3_ring_attention", ring_attn_heads_k_stride=1)
    pc = parallel_context(1, 1, 1, cp=2)
    model = build_qwen2(pc, config)
    load_weights(model=model, parallel_context=pc, root_folder=Path(ckpt))
    cp_rank = dist.get_rank(pc.cp_pg)
    row = torch.randint(3, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(11))
    positions = torch.arange(SEQ).unsqueeze(0)  # GLOBAL under CP; each rank gets its half of the tokens
    params = [p for p in model.parameters() if p.requires_grad]

    def ring_step():
        model.train()
        logits = model.model(input_ids=row[:, cp_rank * SEQ // 2:(cp_rank + 1) * SEQ // 2].contiguous(),
                             position_ids=positions)
        grads = torch.autograd.grad(logits.float().pow(2).mean(), params)
        return logits.detach(), [g.clone() for g in grads]

    def switched():
        attention = [m for m in model.modules() if hasattr(m, "cp_pg_size")]
        return (config._attn_implementation, [(m.cp_pg is pc.cp_pg, m.cp_pg_size) for m in attention])

    before = ring_step()
    state = switched()
    backend = NanotronModel(model, pc, AutoTokenizer.from_pretrained(tokenizer_path(ckpt, None)), max_length=2 * SEQ)
    with torch.no_grad():
        whole_row = backend.forward(rows_batch(row.tolist()))
    scores = summarize(backend, TASKS, 256, 6)
    packing = packing_checks(backend)  # packed rows with CP folded into DP
    block = backend.forward_module.token_position_embeddings
    generation = cached_and_rerun(backend, block.pp_block)  # Qwen2Cache with CP folded into DP; never rings
    after = ring_step()
    halves = [torch.empty_like(before[0]) for _ in range(2)]
    dist.all_gather(halves, before[0].contiguous(), group=pc.cp_pg)
    return {"scores": scores, "layout": backend.layout.describe(),
            "ring_vs_backend": (whole_row - torch.cat(halves)).abs().max().item(),
            "train_step_unchanged": torch.equal(before[0], after[0])
            and all(torch.equal(a, b) for a, b in zip(before[1], after[1])),
            "switched_before": state, "switched_after": switched(), "generation": generation, "packing": packing}


EVAL_SECTION = {"tasks": "demo|arithmetic|0,demo|arithmetic_ppl|0", "interval": 2, "on_save": True,
                "max_samples": 6, "batch_tokens": 512}


def train_layouts(rank, root: Path, tokenizer_dir: str, layouts: list) -> dict:
    """Each (variant, name, parallelism) trained twice by hooks/nanotron_eval.py, with and without the
    `nano_eval:` section: {(variant, name, "with"|"without"): losses}; run folders root/train_<variant>_<name>_*."""
    import torch.distributed as dist

    runs, keys = [], []
    for variant, name, parallel in layouts:
        for kind in ("with", "without"):
            run = root / f"train_{variant}_{name}_{kind}"
            section = {**EVAL_SECTION, "output_dir": str(run / "eval")} if kind == "with" else None
            if rank == 0:
                run.mkdir(parents=True, exist_ok=True)
                write_config(str(run / "train.yaml"), tokenizer_dir, str(run), variant, nano_eval=section, **parallel)
            runs.append({"config": str(run / "train.yaml")})
            keys.append((variant, name, kind))
    dist.barrier()
    losses = train_runs(runs)
    return {key: losses.get(run["config"]) for key, run in zip(keys, runs)}


def install_pp_fix() -> None:
    from tests.nanotron_main_cpu import install

    install(fix_pp=True)


def train_runs(runs: list[dict]) -> dict:
    """hooks/nanotron_eval.py's `main` (the product's launcher, nanotron main's DistributedTrainer) on each run's
    config, one after the other in this world; returns {config: [loss of each step]} from the ranks that hold
    the loss (nanotron's `loss_avg` as its train_step_logs gets it; exact floats)."""
    import functools
    import runpy

    import nanotron.trainer as nt_trainer

    losses: dict = {}
    step_logs = nt_trainer.DistributedTrainer.train_step_logs

    @functools.wraps(step_logs)
    def train_step_logs(self, outputs, loss_avg, *args, **kwargs):
        if loss_avg is not None and not loss_avg.isnan():
            losses.setdefault(current[0], []).append(loss_avg.item())
        return step_logs(self, outputs, loss_avg, *args, **kwargs)

    nt_trainer.DistributedTrainer.train_step_logs = train_step_logs
    hook_script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "hooks" / "nanotron_eval.py"))
    current = [None]
    try:
        for run in runs:
            current[0] = run["config"]
            hook_script["main"](["--config-file", run["config"]])
    finally:
        nt_trainer.DistributedTrainer.train_step_logs = step_logs
    return losses


def cache_vs_scoring(ckpt_dirs: dict, layouts: list) -> dict:
    """For each variant's checkpoint and each (name, tp, pp[, dtype]): nano_eval's Qwen2 KV cache
    (nano_eval.backends.nanotron_qwen2_cache) driven through the KVCache protocol by hand, against the backend's
    scoring forward (the re-run path's forward) on the same tokens. Prompts of 3, 9, 6 and 1 tokens, left-padded;
    three one-token steps; rows selected (one dropped, one repeated, the order changed); then a 3-column extend
    with padding in the middle for some rows (as after a shared prefix); a new prompt prefilled in a cache of its own
    and written into row 1 (continuous batching); the leading columns no row holds dropped. Returns {(variant, layout):
    {"max_diff": max |logit diff| over every call, "calls": how many logits were compared, "reason": the cache's
    refusal (None)}} on lm_head's stage; {(variant, layout): {"reason": ...}} elsewhere."""
    import torch

    from nano_eval.backends.nanotron_qwen2_cache import Qwen2Cache, unsupported_reason
    from nano_eval.checkpoints.nanotron import load_native
    from nano_eval.decoder import first_token_columns
    from nano_eval.rows import last_position_row, left_padded, make_batch

    g = torch.Generator().manual_seed(5)

    def draw(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    out = {}
    for variant, ckpt in ckpt_dirs.items():
        for name, tp, pp, *dtype in layouts:
            backend = load_native(ckpt, None, tp=tp, pp=pp, dtype=(dtype or ["float32"])[0], max_length=None)
            result = out[(variant, name)] = {"reason": unsupported_reason(backend)}
            if result["reason"] is not None:
                continue
            cache, diffs = Qwen2Cache(backend), []
            seqs = [draw(n) for n in (3, 9, 6, 1)]
            ids, real = left_padded(seqs, 0)
            cache.allocate(len(seqs), ids.shape[1] + 8)

            def check(logits):
                want = backend.forward(make_batch([last_position_row(None, s) for s in seqs], 0, with_mask=False))
                assert (logits is None) == (want is None)
                if logits is not None:
                    diffs.append((logits.float() - want.float()).abs().max().item())

            check(cache.run(ids, real))
            for step in range(3):
                new = [draw(1) for _ in seqs]
                seqs = [s + t for s, t in zip(seqs, new)]
                real = torch.cat([real, torch.ones(len(seqs), 1, dtype=torch.bool)], 1)
                check(cache.run(torch.tensor(new), real))
                if step == 0:  # drop row 1, repeat row 3 (the 1-token prompt), reorder
                    keep = [3, 0, 2, 3]
                    cache.select_rows(torch.tensor(keep))
                    seqs, real = [seqs[k] for k in keep], real[keep]
            # three new columns, left-padded within the chunk: rows with 3, 1, 2 and 3 new tokens
            counts = [3, 1, 2, 3]
            new_ids = torch.zeros(len(seqs), 3, dtype=torch.int64)
            new_real = torch.zeros(len(seqs), 3, dtype=torch.bool)
            for r, c in enumerate(counts):
                tokens = draw(c)
                new_ids[r, 3 - c:], new_real[r, 3 - c:] = torch.tensor(tokens), True
                seqs[r] = seqs[r] + tokens
            real = torch.cat([real, new_real], 1)
            check(cache.run(new_ids, real))
            new = [draw(1) for _ in seqs]
            seqs = [s + t for s, t in zip(seqs, new)]
            real = torch.cat([real, torch.ones(len(seqs), 1, dtype=torch.bool)], 1)
            check(cache.run(torch.tensor(new), real))
            # continuous batching: a new prompt prefilled in a cache of its own, copied into row 1 right-aligned
            source, fresh = Qwen2Cache(backend), draw(5)
            source.allocate(1, 5)
            source.run(*left_padded([fresh], 0))
            cache.write_rows(torch.tensor([1]), source)
            seqs[1], real[1] = fresh, False
            real[1, -5:] = True
            new = [draw(1) for _ in seqs]
            seqs = [s + t for s, t in zip(seqs, new)]
            real = torch.cat([real, torch.ones(len(seqs), 1, dtype=torch.bool)], 1)
            check(cache.run(torch.tensor(new), real))
            start = int(first_token_columns(real).min())  # the leading columns no row holds a token in: dropped
            assert start > 0
            cache.select_rows(torch.arange(len(seqs)), start=start, columns=cache.columns - start + 1)
            real = real[:, start:]
            new = [draw(1) for _ in seqs]
            seqs = [s + t for s, t in zip(seqs, new)]
            real = torch.cat([real, torch.ones(len(seqs), 1, dtype=torch.bool)], 1)
            check(cache.run(torch.tensor(new), real))
            if diffs:
                result |= {"max_diff": max(diffs), "calls": len(diffs)}
    return out


def generation_vs_rerun(ckpt_dirs: dict, layouts: list) -> dict:
    """For each variant's checkpoint and each (name, tp, pp[, dtype]): tests/generation_checks.py's greedy generations
    through the backend's KV-cache decoder (Qwen2Cache under nano_eval.decoder's driver) and through the re-run
    path, with and without a stop sequence that rows hit at different steps: {(variant, layout): its result}, plus
    "shared": both paths on prompts with a long common prefix, which the decoder prefills once (`shared_prefix`:
    the longest prefix a prefill shared)."""
    from nano_eval.backends.base import evaluation_mode
    from nano_eval.checkpoints.nanotron import load_native
    from nano_eval.decoder import CacheDecoder
    from nano_eval.engine import BatchingConfig, Engine
    from nano_eval.tasks.requests import GreedyUntilRequest
    from tests.generation_checks import Rerunning, cached_and_rerun

    shared, prefill = [0], CacheDecoder._prefill

    def recorded(self, *args):
        out = prefill(self, *args)
        shared.append(self.shared)
        return out

    prompts = ["Question: what is the sum of all the numbers from one to ten? " + tail
               for tail in ("Answer:", "Think, then answer:", "A")]
    requests = [GreedyUntilRequest("s", i, 0, p, stop_sequence=[], generation_size=8) for i, p in enumerate(prompts)]

    def generate_shared(backend):
        engine = Engine(backend, BatchingConfig(max_batch_tokens=400, max_batch_size=2, shared_prefix_tokens=8),
                        progress=False)
        results = engine.run_greedy(engine.prepare_greedy(requests))
        return {k: r.tokens for k, r in sorted(results.items())}

    out = {}
    for variant, ckpt in ckpt_dirs.items():
        for name, tp, pp, *dtype in layouts:
            backend = load_native(ckpt, None, tp=tp, pp=pp, dtype=(dtype or ["float32"])[0], max_length=None)
            block = backend.forward_module.token_position_embeddings  # its module on the input stage only
            result = out[(variant, name)] = cached_and_rerun(backend, getattr(block, "pp_block", None))
            shared[:] = [0]
            CacheDecoder._prefill = recorded
            try:
                with evaluation_mode(backend.module):
                    cached, rerun = generate_shared(backend), generate_shared(Rerunning(backend))
                result["shared"] = {"cached": cached, "rerun": rerun, "shared_prefix": max(shared)}
            finally:
                CacheDecoder._prefill = prefill
    return out
