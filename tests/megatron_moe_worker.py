"""Code that runs inside each spawned rank of the Mixture-of-Experts tests (tests/test_megatron_moe.py):
megatron-core's real MoE GPTModel (tests/megatron_moe.py) under expert, tensor, pipeline and context parallelism on
gloo, through the CPU test double tests/megatron_cpu.py.

The reference is the same weights at ep1 x tp1 x pp1 (dp4) with dropless routing. Every other layout is built the
way training runs it, with a capacity factor (token dropping) and, for the alltoall dispatcher, padding to capacity;
MegatronModel must score it dropless, in lockstep across data-parallel ranks (7 documents and a small token budget
give ranks different numbers of batches and generation steps), exactly like the reference.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

TASKS = "demo|arithmetic|0,demo|arithmetic_gen|0"  # the slow set adds demo|arithmetic_ppl|0 (rolling windows)
MAX_SAMPLES, BATCH_TOKENS, MICRO_BATCH = 7, 32, 2  # data-parallel ranks get different numbers of batches
CAPACITY = 1.0  # a common training setting: tokens past an expert's capacity are dropped
# name: (tp, pp, ep, cp) in a world of 4; dp = 4 / (tp x pp) counts the CP ranks
LAYOUTS = {"ep2": (1, 1, 2, 1), "tp2xep2": (2, 1, 2, 1), "pp2xep2": (1, 2, 2, 1), "cp2xep2": (1, 1, 2, 2),
           "pp2xcp2": (1, 2, 1, 2)}
# the default suite's layout x dispatcher pairs (EP with TP; CP folded into DP); the rest: slow_moe_checks
DEFAULT = (("tp2xep2", "alltoall"), ("cp2xep2", "alltoall"))
SLOW_TASKS = TASKS + ",demo|arithmetic_ppl|0"
# generation: 7 prompts of mixed lengths, two generation sizes (a batch holds one), a token budget of ~3 rows
GEN_PROMPTS = [f"Question: {i} plus {5 * i}\nAnswer:" + " so" * (i % 4) for i in range(7)]
GEN_SIZES, GEN_BATCH_TOKENS = (12, 5), 60
ITERATION = 100


def _setup(tp=1, pp=1, ep=1, cp=1, gloo_groups=False):
    from tests.megatron_worker import _setup as setup

    setup(tp, pp, gloo_groups=gloo_groups, ep=ep, cp=cp)


def _tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


class _Rerunning:
    """The backend without its KV-cache decoder (generation re-runs the prompt every token), still in lockstep."""

    def __init__(self, backend):
        self.forward, self.layout, self.module, self.lockstep = (backend.forward, backend.layout, backend.module,
                                                                 backend.lockstep)
        self.tokenizer, self.max_length = backend.tokenizer, backend.max_length


def generations(backend, stop: list[str]) -> dict:
    """{request key: (generated tokens, text)} of GEN_PROMPTS at GEN_SIZES, batches of ~3 rows, in evaluation
    mode."""
    from nano_eval.backends.base import evaluation_mode
    from nano_eval.engine import BatchingConfig, Engine
    from nano_eval.tasks.requests import GreedyUntilRequest

    requests = [GreedyUntilRequest("g", i, 0, p, stop_sequence=stop, generation_size=GEN_SIZES[i % 2])
                for i, p in enumerate(GEN_PROMPTS)]
    engine = Engine(backend, BatchingConfig(max_batch_tokens=GEN_BATCH_TOKENS), progress=False)
    with evaluation_mode(backend.module):
        results = engine.run_greedy(engine.prepare_greedy(requests))
    return {k: (r.tokens, r.text) for k, r in sorted(results.items())}


class ForwardCounter:
    """Counts every forward of a MegatronModel (`run`: scoring batches, prefills, decoding steps); of its `forward`
    calls (scoring batches, and the re-run generation path's steps), the dummy ones (all padding) and the seconds
    spent in them; and the tokens lockstep padding adds to the loglikelihood batches (instrumentation of
    nano_eval.engine's call of nano_eval.lockstep.padded_batch); `over`: every forward's batch and every KV cache
    the decoder sizes or resizes (rows x columns: a pool's prompt width + max new tokens, a refill's prompt width) of
    more than one row and more than `budget` positions (set it to the --batch-tokens of what runs next)."""

    def __init__(self, backend):
        import nano_eval.engine as engine

        self.stats = {"runs": 0, "scoring": 0, "dummy": 0, "scoring_s": 0.0, "dummy_s": 0.0,
                      "tokens": 0, "padded_tokens": 0, "over": []}
        self.budget = None
        run, forward, pad = backend.run, backend.forward, engine.padded_batch
        make_decoder = backend.incremental_decoder

        def counted_decoder(*args, **kwargs):
            decoder = make_decoder(*args, **kwargs)
            if decoder is not None:
                make = decoder.make_cache

                def checked_cache():  # every cache the decoder sizes: rows x columns within the budget
                    cache = make()
                    allocate, select = cache.allocate, cache.select_rows

                    def checked_allocate(rows, columns):
                        self._check(rows, columns)
                        return allocate(rows, columns)

                    def checked_select(index, start=0, columns=None):
                        select(index, start, columns)
                        self._check(len(index), cache.context.max_sequence_length)

                    cache.allocate, cache.select_rows = checked_allocate, checked_select
                    return cache

                decoder.make_cache = checked_cache
            return decoder

        def counted_run(*args, **kwargs):
            self.stats["runs"] += 1
            return run(*args, **kwargs)

        def counted_forward(batch):
            start = time.perf_counter()
            out = forward(batch)
            seconds, dummy = time.perf_counter() - start, int(batch.attention_mask.sum()) == 0
            self.stats["scoring"] += 1
            self._check(*batch.input_ids.shape)
            self.stats["scoring_s"] += seconds
            self.stats["dummy"] += dummy
            self.stats["dummy_s"] += seconds if dummy else 0.0
            return out

        def counted_pad(batch, rows, columns, pad_id):
            self.stats["tokens"] += 0 if batch is None else batch.input_ids.numel()
            self.stats["padded_tokens"] += rows * columns - (0 if batch is None else batch.input_ids.numel())
            return pad(batch, rows, columns, pad_id)

        backend.run, backend.forward, engine.padded_batch = counted_run, counted_forward, counted_pad
        backend.incremental_decoder = counted_decoder
        self._undo = lambda: setattr(engine, "padded_batch", pad)

    def _check(self, rows: int, columns: int) -> None:
        if rows > 1 and rows * columns > self.budget:
            self.stats["over"].append((rows, columns, self.budget))

    def close(self) -> dict:
        self._undo()
        return self.stats


def score(backend, tasks: str = TASKS) -> dict:
    """Scores on `tasks` (7 documents, small batches), generations with the KV cache (with and without a stop
    sequence) and re-running the prompt (with it), the layout as results.json records it, and forward counts."""
    from tests.nanotron_worker import summarize
    from tests.packing_checks import packed_vs_unpacked

    packing = packed_vs_unpacked(backend, max_batch_tokens=4 * BATCH_TOKENS, pack_tokens=64)  # in lockstep
    counter = ForwardCounter(backend)
    counter.budget = BATCH_TOKENS
    start = time.perf_counter()
    # one document per row (pack_tokens=0): the 7 documents then give the DP ranks different numbers of batches
    out = {"scores": summarize(backend, tasks, BATCH_TOKENS, MAX_SAMPLES, pack_tokens=0), "packing": packing}
    out["scoring_s"] = time.perf_counter() - start
    counter.budget = GEN_BATCH_TOKENS
    out["generations"] = generations(backend, [])
    stop = [next(iter(out["generations"].values()))[1][3]]  # a character the rows reach at different steps
    out["generations_stop"] = generations(backend, stop)
    out["rerun_generations"] = generations(_Rerunning(backend), stop)
    out["forwards"] = counter.close()
    out["layout"], out["lockstep"] = backend.layout.describe(), backend.lockstep
    return out


def moe_backend(tokenizer_dir, tp=1, pp=1, ep=1, cp=1, **options):
    """parallel_state in (tp, pp, ep, cp), this rank's MoE model (`options` to tests.megatron_moe.moe_config) behind
    MegatronModel. Under cp > 1 the model is built with config cp = 1 (megatron's local attention refuses more) and
    the config then says cp as a CP model's would: parallel_state and the rotary embedding hold the real CP group."""
    from nano_eval.backends.megatron import MegatronModel
    from tests.megatron_gpt import GPTConfig
    from tests.megatron_moe import build_moe_model

    _setup(tp, pp, ep, cp)
    model = build_moe_model(**options)
    model.config.context_parallel_size = cp
    return MegatronModel([model], _tokenizer(tokenizer_dir), max_length=GPTConfig().max_position_embeddings,
                         micro_batch_size=MICRO_BATCH)


def restore_checks(tokenizer_dir) -> dict:
    """ep2 (dp4), alltoall with capacity factor and padding to capacity, aux loss: a training-mode forward with grad
    (megatron counts tokens and logs the aux loss) before and after an evaluation gives bitwise the same output; the
    router counters, the aux-loss tracker, the capacity settings on configs and dispatchers are as training left
    them, after the evaluation and after a backend forward run with grad enabled in training mode."""
    import torch
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    from nano_eval.rows import make_batch, plain_row
    from tests.nanotron_worker import summarize

    backend = moe_backend(tokenizer_dir, ep=2, capacity=CAPACITY, pad_to_capacity=True, balancing="aux_loss",
                          aux_loss=1e-2, expert_bias=True)
    model = backend.chunks[0]
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 544, (2, 16), generator=g)
    positions = torch.arange(16).expand(2, 16)

    def training_forward():
        model.train()
        with torch.enable_grad():
            return model(ids, positions, None).detach().clone()

    def state():
        routers = [m for m in model.modules() if getattr(m, "local_tokens_per_expert", None) is not None]
        tracker = get_moe_layer_wise_logging_tracker()
        dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
        return {"tokens_per_expert": [r.local_tokens_per_expert.clone() for r in routers],
                "expert_bias": [r.expert_bias.clone() for r in routers],
                "tracker": {k: v["values"].clone() for k, v in tracker.items()},
                "config": (model.config.moe_expert_capacity_factor, model.config.moe_pad_expert_input_to_capacity),
                "dispatchers": [(d.drop_and_pad, getattr(d, "moe_expert_capacity_factor", None)) for d in dispatchers]}

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    before = training_forward()
    trained = state()
    summarize(backend, "demo|arithmetic|0,demo|arithmetic_gen|0", BATCH_TOKENS, MAX_SAMPLES)
    after_eval = state()
    model.train()
    with torch.enable_grad():  # a forward megatron-core 0.16 counts and logs
        backend.forward(make_batch([plain_row("x", ids[0, :8].tolist(), ids[0, 8:].tolist())], 0, False))
    after_grad_forward = state()
    after = training_forward()
    return {"counted": bool(sum(t.sum() for t in trained["tokens_per_expert"])) and bool(trained["tracker"]),
            "state_after_eval": same(trained, after_eval), "state_after_grad_forward": same(trained,
                                                                                       after_grad_forward),
            "training_forward_bitwise": torch.equal(before, after), "capacity": trained["config"],
            "dispatchers": trained["dispatchers"]}


def save_moe_checkpoint(root: Path, ep: int = 2, dispatcher: str = "alltoall") -> dict:
    """The reference MoE weights built at ep (world 4: dp4) with a training capacity factor, saved as torch_dist with
    Megatron-LM's args (tests/megatron_moe.py: moe_args) under root/moe_ep{ep}/iter_0000100, the way
    tests/megatron_worker.py's save_dist_checkpoint saves the dense ones."""
    from tests.megatron_moe import build_moe_model, moe_args
    from tests.megatron_worker import save_dist_checkpoint

    _setup(ep=ep)
    model = build_moe_model(dispatcher=dispatcher, capacity=CAPACITY)
    args = moe_args(ep=ep, dispatcher=dispatcher, capacity=CAPACITY)
    args.save = root / f"moe_ep{ep}"
    save_dist_checkpoint(model, args, root / f"moe_ep{ep}", ITERATION)
    return {"path": str(root / f"moe_ep{ep}" / f"iter_{ITERATION:07d}")}


def layout_scores(tokenizer_dir, name: str, dispatcher: str, tasks: str = TASKS) -> dict:
    """The MoE model in layout `name` with the training capacity factor (alltoall: padded to capacity), scored."""
    tp, pp, ep, cp = LAYOUTS[name]
    return score(moe_backend(tokenizer_dir, tp, pp, ep, cp, dispatcher=dispatcher, capacity=CAPACITY,
                             pad_to_capacity=dispatcher == "alltoall"), tasks)


def moe_checks(tokenizer_dir, root) -> dict:
    """The default suite's MoE stages, run inside tests/megatron_worker.py's world of 4 (the `megatron_world`
    fixture: one spawn for every Megatron test): the ep1 dropless reference; tp2 x ep2 and cp2 x ep2 (CP emulated),
    alltoall with a capacity factor; the restore checks; an ep2 torch_dist save, loaded at ep1 by `--backend
    megatron`."""
    from tests.megatron_worker import _timed

    stages = [("reference", lambda: score(moe_backend(tokenizer_dir)))]
    stages += [(f"{name}/{d}", lambda name=name, d=d: layout_scores(tokenizer_dir, name, d)) for name, d in DEFAULT]
    stages += [("restore", lambda: restore_checks(tokenizer_dir)), ("saved", lambda: save_moe_checkpoint(Path(root))),
               ("native/ep1", lambda: native_scores(tokenizer_dir, Path(root), "ep1")),
               ("lm_eval", lambda: lm_eval_checks(tokenizer_dir, Path(root)))]
    return _timed(stages)


def lm_eval_checks(tokenizer_dir, root: Path) -> dict:
    """tests/lm_eval_layouts.py's lm-eval tasks (few-shot multiple choice, filtered greedy generation, rolling
    perplexity; 7 documents, small batches) on the ep1 dropless reference (dp4) and at ep2 (dp4) built with the
    training capacity factor, alltoall padded to capacity: scored dropless in lockstep over uneven data-parallel
    shards. Forward counts of the ep2 run; the request strings a world of one builds (`alone`: lm-eval issue #1719);
    lm-eval's YAMLs written by rank 0 under root."""
    import importlib.util

    import torch.distributed as dist

    from tests.lm_eval_layouts import built_alone, summarize, write_include_dir

    if importlib.util.find_spec("lm_eval") is None:
        return {"skipped": "lm-evaluation-harness is not installed"}
    include = root / "lm_eval_tasks"
    if dist.get_rank() == 0:
        write_include_dir(include)
    dist.barrier()
    out = {"reference": summarize(moe_backend(tokenizer_dir), include, BATCH_TOKENS, MAX_SAMPLES)}
    tp, pp, ep, cp = LAYOUTS["ep2"]
    backend = moe_backend(tokenizer_dir, tp, pp, ep, cp, dispatcher="alltoall", capacity=CAPACITY,
                          pad_to_capacity=True)
    counter = ForwardCounter(backend)
    counter.budget = BATCH_TOKENS
    out["ep2"] = summarize(backend, include, BATCH_TOKENS, MAX_SAMPLES)
    out["forwards"], out["lockstep"], out["layout"] = counter.close(), backend.lockstep, backend.layout.describe()
    out["alone"] = built_alone(include, MAX_SAMPLES)  # the requests as a world of one builds them, without a model
    return out


NATIVE = {"ep1": (1, 1, 1), "tp2xep2": (2, 1, 2)}  # layouts `--backend megatron` loads the ep2 save in: (tp, pp, ep)


def native_scores(tokenizer_dir, root: Path, name: str, tasks: str = TASKS) -> dict:
    """`run.py --backend megatron --tp T --pp P --ep E` on the ep2 torch_dist save (trained with a capacity factor,
    saved with it in its args): nano_eval builds the MoE GPTModel from those args and megatron-core reshards the
    experts into the layout; scored like the live layouts (tp2 x ep2: with generations, in lockstep)."""
    from nano_eval.checkpoints.megatron_native import load_native
    from tests.nanotron_worker import summarize

    tp, pp, ep = NATIVE[name]
    backend = load_native(str(root / "moe_ep2"), str(tokenizer_dir), tp=tp, pp=pp, ep=ep, dtype="float32",
                          max_length=None, device="cpu")
    backend.micro_batch_size = MICRO_BATCH
    if ep == 1:
        return {"scores": summarize(backend, tasks, BATCH_TOKENS, MAX_SAMPLES), "layout": backend.layout.describe()}
    return score(backend, tasks)


def slow_moe_checks(tokenizer_dir, root) -> dict:
    """The slow set's MoE stages, run inside tests/megatron_worker.py's slow world of 4 (`megatron_slow_world`):
    the reference and every other layout x dispatcher on SLOW_TASKS (the rolling-window task added), the ep2 save
    loaded at tp2 x ep2 by `--backend megatron`, then Megatron-style training (DDP + distributed optimizer, aux
    loss, expert bias, a capacity factor) at ep2 and pp2 x ep2 with and without the hook."""
    from tests.megatron_worker import _timed

    stages = [("reference", lambda: score(moe_backend(tokenizer_dir), SLOW_TASKS))]
    stages += [(f"{name}/{d}", lambda name=name, d=d: layout_scores(tokenizer_dir, name, d, SLOW_TASKS))
               for name in LAYOUTS for d in ("alltoall", "allgather") if (name, d) not in DEFAULT]
    stages += [("saved", lambda: save_moe_checkpoint(Path(root))),
               ("native/tp2xep2", lambda: native_scores(tokenizer_dir, Path(root), "tp2xep2", SLOW_TASKS))]
    stages += [(f"training/{name}", lambda name=name: moe_training(tokenizer_dir, Path(root), name))
               for name in ("ep2", "pp2xep2")]
    return _timed(stages)


def moe_training(tokenizer_dir, root: Path, name: str) -> dict:
    """tests/megatron_worker.py's Megatron-style training run on the MoE model in layout `name` (dropout, aux loss,
    aux-loss-free expert bias, capacity factor with padding), without and with the hook (7 documents, small
    batches: uneven DP shards); the trained model saved as torch_dist at the last iteration with the hook's scores
    of it, for `--backend megatron` to reproduce."""
    from nano_eval.compat.megatron import unwrap
    from nano_eval.training.config import EvalHookConfig
    from nano_eval.training.megatron import make_non_loss_data_func
    from tests.megatron_moe import build_moe_model, moe_args
    from tests.megatron_worker import TRAIN_ITERS, save_dist_checkpoint, train_like_megatron, training_args

    import torch.distributed as dist

    tp, pp, ep, _ = LAYOUTS[name]
    chunks, options = [], dict(capacity=CAPACITY, pad_to_capacity=True, balancing="aux_loss", aux_loss=1e-2,
                               expert_bias=True)

    def build():
        chunks[:] = [build_moe_model(dropout=0.1, **options)]
        return list(chunks)

    without = train_like_megatron(None, training_args(), layout=(tp, pp, ep), build=build)
    config = EvalHookConfig(tasks=TASKS, max_samples=MAX_SAMPLES, batch_tokens=BATCH_TOKENS, wandb=False,
                            output_dir=root / f"hook_{name}")
    args = training_args()
    hook = make_non_loss_data_func(config, _tokenizer(tokenizer_dir), get_args=lambda: args,
                                   micro_batch_size=MICRO_BATCH)
    with_hook = train_like_megatron(hook, args, layout=(tp, pp, ep), build=build)
    hook.close()
    saved = root / f"moe_trained_{name}"
    save_dist_checkpoint(unwrap(chunks[0]), moe_args(tp=tp, pp=pp, ep=ep, **options), saved, TRAIN_ITERS)
    live = {k: tr.metrics for k, tr in hook.last[1].tasks.items()} if hook.last[1] is not None else None
    if dist.get_rank() == 0:  # what `--backend megatron` on the checkpoint should reproduce
        (saved / "live_scores.json").write_text(json.dumps({"iteration": TRAIN_ITERS, "scores": live}))
    return {"without": {k: without[k] for k in ("train", "valid")},
            "with": {k: with_hook[k] for k in ("train", "valid", "hook")},
            "evaluated_steps": hook.hook.evaluated_steps, "saved": str(saved / f"iter_{TRAIN_ITERS:07d}"),
            "live_scores": live}
