"""Code that runs inside each spawned rank of the nanotron tests."""

from pathlib import Path

VOCAB = 544  # >= the toy tokenizer's 537 tokens, divisible by every TP degree tested


def evaluate_layout(rank, world, tp, pp, dp, tokenizer_dir, tasks, batch_tokens=256, max_samples=16):
    """Build the toy nanotron model in a tp x pp x dp layout and evaluate `tasks`; returns a summary per task."""
    from transformers import AutoTokenizer

    from nano_eval.compat.nanotron import cpu_parallel_context
    from nano_eval.engine import BatchingConfig
    from nano_eval.evaluator import EvalConfig, Evaluator
    from nano_eval.models.nanotron_model import NanotronModel
    from nano_eval.tasks import Registry
    from nano_eval.toy_nanotron import ToyConfig, build_toy_nanotron_model

    pc = cpu_parallel_context(tp=tp, pp=pp, dp=dp)
    cfg = ToyConfig(vocab_size=VOCAB)
    model = build_toy_nanotron_model(pc, cfg)
    backend = NanotronModel(model, pc, AutoTokenizer.from_pretrained(tokenizer_dir), max_length=cfg.max_position_embeddings)
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
