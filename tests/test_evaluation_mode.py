"""Scoring a live model leaves it exactly as it was: train/eval flags, RNG streams, gradients."""

import random

import numpy as np
import torch

from nano_eval.checkpoints.hf import load_transformers
from nano_eval.evaluator import EvalConfig, Evaluator
from nano_eval.tasks import Registry


def test_evaluate_restores_training_state_and_rng(toy_checkpoint):
    backend = load_transformers(str(toy_checkpoint))
    model = backend.model
    model.train()
    model.model.layers[0].eval()  # a submodule the trainer froze: must stay in eval mode
    next(model.parameters()).grad = grad = torch.ones_like(next(model.parameters()))
    registry = Registry()
    specs = registry.parse_specs("demo|arithmetic|0")
    tasks = registry.get_task_dict(specs)
    evaluator = Evaluator(backend, [(s, tasks[s.full_name]) for s in specs], EvalConfig(max_samples=4, progress=False))
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    flags_before = [m.training for m in model.modules()]

    seen_training = []
    hook = model.model.register_forward_pre_hook(lambda m, args: seen_training.append(m.training))
    evaluator.evaluate(step=1)
    hook.remove()

    assert seen_training and not any(seen_training)  # scored in eval mode
    assert [m.training for m in model.modules()] == flags_before
    assert next(model.parameters()).grad is grad
    expected = (torch.Generator().manual_seed(7), random.Random(7), np.random.RandomState(7))
    assert torch.rand(3).tolist() == torch.rand(3, generator=expected[0]).tolist()
    assert random.random() == expected[1].random()
    assert np.random.rand() == expected[2].rand()


def test_generation_without_kv_cache_is_noted_once_on_rank_0(capsys):
    """A backend whose model cannot decode from a KV cache says so (and why) once, on global rank 0 only."""
    from types import SimpleNamespace

    from nano_eval.backends.base import note_rerun_generation
    from nano_eval.parallel import ParallelLayout

    main = SimpleNamespace(layout=ParallelLayout())
    note_rerun_generation(main, "tp_mode REDUCE_SCATTER")
    note_rerun_generation(main, "tp_mode REDUCE_SCATTER")
    other = SimpleNamespace(layout=ParallelLayout(rank=1, world_size=2, dp_rank=1, dp_size=2))
    note_rerun_generation(other, "tp_mode REDUCE_SCATTER")
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["nano_eval: note: SimpleNamespace generates without a KV cache (tp_mode REDUCE_SCATTER): every "
                     "new token re-runs the prompt, so generation costs prompt x answer tokens."]
