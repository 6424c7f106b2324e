"""Code that runs inside each spawned rank of the nanotron tests."""

from pathlib import Path

VOCAB = 544  # >= the toy tokenizer's 537 tokens, divisible by every TP degree tested


def evaluate_layout(rank, world, tp, pp, dp, tokenizer_dir, tasks, batch_tokens=256, max_samples=16, qwen_style=False):
    """Build the toy nanotron model in a tp x pp x dp layout and evaluate `tasks`; returns a summary per task."""
    from nano_eval.compat.nanotron import cpu_parallel_context
    from tests.toy_nanotron import ToyConfig, build_toy_nanotron_model

    pc = cpu_parallel_context(tp=tp, pp=pp, dp=dp)
    cfg = ToyConfig(vocab_size=VOCAB, position_ids_input=qwen_style)
    model = build_toy_nanotron_model(pc, cfg)
    return evaluate_model(model, pc, cfg, tokenizer_dir, tasks, batch_tokens=batch_tokens, max_samples=max_samples)


def evaluate_model(model, pc, cfg, tokenizer_dir, tasks, batch_tokens=256, max_samples=16):
    """Evaluate `tasks` on a built nanotron `model` with the NanotronModel backend; returns a summary per task."""
    from transformers import AutoTokenizer

    from nano_eval.backends.nanotron import NanotronModel

    backend = NanotronModel(model, pc, AutoTokenizer.from_pretrained(tokenizer_dir), max_length=cfg.max_position_embeddings)
    return summarize(backend, tasks, batch_tokens, max_samples)


def summarize(backend, tasks, batch_tokens, max_samples):
    """Evaluate `tasks` with any backend: metrics, per-document log-probs and predictions per task."""
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.tasks import Registry

    registry = Registry()
    specs = registry.parse_specs(tasks)
    task_dict = registry.get_task_dict(specs)
    config = EvalConfig(max_samples=max_samples, batching=BatchingConfig(max_batch_tokens=batch_tokens), progress=False)
    results = Evaluator(backend, [(s, task_dict[s.full_name]) for s in specs], config).evaluate()
    return {
        key: {
            "metrics": {k: v for k, v in tr.metrics.items() if not k.endswith("_stderr")},
            "logprobs": [d["logprobs"] for d in tr.details],
            "predictions": [d.get("predictions") for d in tr.details],
        }
        for key, tr in results.tasks.items()
    }


def peak_scoring_memory_mb(rank, world, tp, vocab, tokenizer_dir):
    """Rise of this rank's peak resident memory (MiB) while scoring 2048 positions with a `vocab`-sized head."""
    import resource

    from transformers import AutoTokenizer

    from nano_eval.backends.nanotron import NanotronModel
    from nano_eval.compat.nanotron import cpu_parallel_context
    from nano_eval.engine import Engine
    from nano_eval.tasks.requests import LoglikelihoodRequest
    from tests.toy_nanotron import ToyConfig, build_toy_nanotron_model

    pc = cpu_parallel_context(tp=tp, pp=1, dp=1)
    cfg = ToyConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=256)
    backend = NanotronModel(build_toy_nanotron_model(pc, cfg), pc, AutoTokenizer.from_pretrained(tokenizer_dir),
                            max_length=cfg.max_position_embeddings)
    engine = Engine(backend, progress=False)
    text = "one two three four five six seven eight nine ten " * 24
    requests = [LoglikelihoodRequest("t", i, 0, "", choice=text) for i in range(8)]  # every position is scored
    dataset = engine.prepare_loglikelihood(requests)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine.run_loglikelihood(dataset)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def save_and_evaluate_checkpoint(rank, world, tp, pp, dp, ckpt_dir, tokenizer_dir, tasks, save_seed=0, load_seed=1,
                                 batch_tokens=4096, max_samples=12):
    """Save the seed-`save_seed` toy model with nanotron's `save_weights` (+ `checkpoint_metadata.json`, as nanotron's
    trainer writes it), then load it back into a seed-`load_seed` model in the same layout and evaluate that."""
    import torch.distributed as dist

    from nano_eval.compat.nanotron import cpu_parallel_context, import_nanotron
    from tests.toy_nanotron import ToyConfig, build_toy_nanotron_model

    import_nanotron()
    from nanotron.serialize import save_weights
    from nanotron.serialize.metadata import save_meta

    pc = cpu_parallel_context(tp=tp, pp=pp, dp=dp)
    cfg = ToyConfig(vocab_size=VOCAB)
    model = build_toy_nanotron_model(pc, cfg, seed=save_seed)
    save_weights(model, pc, Path(ckpt_dir))  # under numpy 2 it writes shapes like "(np.int64(192), 64)"
    save_meta(pc, Path(ckpt_dir), {"last_train_step": 0, "consumed_train_samples": 0})
    dist.barrier()  # every rank's shards are on disk before anyone reads them
    return {"loaded": _load_and_evaluate(pc, cfg, ckpt_dir, tokenizer_dir, tasks, load_seed, batch_tokens, max_samples)}


def evaluate_checkpoint(rank, world, tp, pp, dp, ckpt_dir, tokenizer_dir, tasks, load_seed=1, reference_seed=None,
                        batch_tokens=4096, max_samples=12):
    """Load the checkpoint into a seed-`load_seed` toy model with nanotron's `load_weights` (which reshards TP) and
    evaluate it. With `reference_seed`, also evaluate the seed-`reference_seed` model built directly and the
    seed-`load_seed` model before loading (so a load that does nothing is caught)."""
    from nano_eval.compat.nanotron import cpu_parallel_context
    from tests.toy_nanotron import ToyConfig, build_toy_nanotron_model

    pc = cpu_parallel_context(tp=tp, pp=pp, dp=dp)
    cfg = ToyConfig(vocab_size=VOCAB)
    out = {"loaded": _load_and_evaluate(pc, cfg, ckpt_dir, tokenizer_dir, tasks, load_seed, batch_tokens, max_samples)}
    if reference_seed is not None:
        for key, seed in (("reference", reference_seed), ("unloaded", load_seed)):
            model = build_toy_nanotron_model(pc, cfg, seed=seed)
            out[key] = evaluate_model(model, pc, cfg, tokenizer_dir, tasks, batch_tokens=batch_tokens,
                                      max_samples=max_samples)
    return out


def _load_and_evaluate(pc, cfg, ckpt_dir, tokenizer_dir, tasks, seed, batch_tokens, max_samples):
    from nano_eval.compat.nanotron import import_nanotron
    from tests.toy_nanotron import build_toy_nanotron_model

    import_nanotron()
    from nanotron.serialize import load_weights

    model = build_toy_nanotron_model(pc, cfg, seed=seed)
    load_weights(model, pc, Path(ckpt_dir))
    return evaluate_model(model, pc, cfg, tokenizer_dir, tasks, batch_tokens=batch_tokens, max_samples=max_samples)


def evaluate_with_failing_rank(rank, world, tokenizer_dir, failing_rank=1):
    """TP2: `failing_rank`'s forward raises on its second batch. Returns (outcome, seconds) on every rank, so the
    test sees how each rank ended instead of the harness killing the survivors."""
    import time

    from transformers import AutoTokenizer

    from nano_eval.backends.nanotron import NanotronModel
    from nano_eval.compat.nanotron import cpu_parallel_context
    from tests.toy_nanotron import ToyConfig, build_toy_nanotron_model

    pc = cpu_parallel_context(tp=world, pp=1, dp=1)
    cfg = ToyConfig(vocab_size=VOCAB)
    backend = NanotronModel(build_toy_nanotron_model(pc, cfg), pc, AutoTokenizer.from_pretrained(tokenizer_dir),
                            max_length=cfg.max_position_embeddings)
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
        summarize(backend, "demo|arithmetic|0", batch_tokens=64, max_samples=12)
        return "finished", time.monotonic() - start
    except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
        return f"{type(e).__name__}: {e}", time.monotonic() - start
