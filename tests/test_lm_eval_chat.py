"""--use-chat-template for lm_eval|... tasks: lm-eval builds the conversation (apply_chat_template=True,
fewshot_as_multiturn=True, --system-prompt as its system_instruction) and nano_eval's sandboxed renderer renders it
with the model's template. Parity with lm-eval's own simple_evaluate(apply_chat_template=True) and its hf model
(HFLM) on the toy model, its tokenizer given a chat template: identical request strings, log-probs, generations
and metrics; a template that refuses the system role falls back as HFLM does; a task with gen_prefix is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from nano_eval.errors import UnsupportedTaskError  # noqa: E402
from nano_eval.evaluator import EvalConfig, Evaluator  # noqa: E402
from nano_eval.tasks import load_tasks  # noqa: E402
from nano_eval.tasks import lm_eval_tasks as lmt  # noqa: E402
from nano_eval.tasks import lm_eval_examples as examples  # noqa: E402
from tests.test_lm_eval_tasks import LIMIT, _compare_task  # noqa: E402

# ChatML-like, each turn opened by the toy tokenizer's one special token (so contexts start with it: no BOS added)
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + TEMPLATE)
SYSTEM = "Add the two numbers."


@pytest.fixture(scope="module")
def include_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_chat")
    examples.write_include_dir(root, examples.multiple_choice("nano_toy_mc"), examples.generation("nano_toy_gen"),
                               {**examples.generation("nano_toy_prefix"), "gen_prefix": "The sum is"})
    return root


@pytest.fixture(scope="module")
def chat_backend(toy_checkpoint):
    """The toy model with its own tokenizer object, given a chat template (the session's toy_backend stays plain)."""
    from nano_eval.checkpoints.hf import load_transformers

    backend = load_transformers(str(toy_checkpoint))
    backend.tokenizer.chat_template = TEMPLATE
    return backend


def _reference(backend, name: str, shots: int, include_dir, system: str | None) -> dict:
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=backend.module, tokenizer=backend.tokenizer, batch_size=4, max_length=backend.max_length,
              device="cpu")
    return lm_eval.simple_evaluate(model=lm, tasks=[name], num_fewshot=shots, limit=LIMIT, log_samples=True,
                                   task_manager=lmt.task_manager(include_dir), bootstrap_iters=1000,
                                   apply_chat_template=True, system_instruction=system)


def _ours(backend, spec: str, include_dir, system: str | None) -> dict:
    tasks = load_tasks(spec, lm_eval_include_path=include_dir)
    config = EvalConfig(max_samples=LIMIT, progress=False, use_chat_template=True, system_prompt=system,
                        lm_eval_bootstrap_iters=1000)
    results = Evaluator(backend, tasks, config).evaluate()
    assert not results.failed, results.failed
    return results.tasks


@pytest.mark.parametrize("name, shots, system", [("nano_toy_mc", 2, None), ("nano_toy_gen", 1, SYSTEM)])
def test_parity_with_lm_evals_apply_chat_template(include_dir, chat_backend, name, shots, system):
    ours = _ours(chat_backend, f"lm_eval|{name}|{shots}", include_dir, system)[f"lm_eval|{name}|{shots}"]
    reference = _reference(chat_backend, name, shots, include_dir, system)
    _compare_task(ours, reference["samples"][name], reference["results"][name])
    context = ours.details[0]["arguments"][0][0]
    assert context.startswith("<|endoftext|>" + ("system" if system else "user"))  # rendered by the template
    assert context.count("<|endoftext|>assistant\n") == shots + 1  # few-shot answers as turns, then the opener


def test_a_template_without_a_system_role_drops_it_as_lm_evals_hf_model(include_dir, chat_backend):
    chat_backend.tokenizer.chat_template = NO_SYSTEM
    try:
        ours = _ours(chat_backend, "lm_eval|nano_toy_gen|0", include_dir, SYSTEM)["lm_eval|nano_toy_gen|0"]
        reference = _reference(chat_backend, "nano_toy_gen", 0, include_dir, SYSTEM)
    finally:
        chat_backend.tokenizer.chat_template = TEMPLATE
    _compare_task(ours, reference["samples"]["nano_toy_gen"], reference["results"]["nano_toy_gen"])
    assert SYSTEM not in ours.details[0]["arguments"][0][0]


def test_a_task_that_begins_the_answer_itself_is_refused_with_a_chat_template(include_dir, chat_backend):
    tasks = load_tasks("lm_eval|nano_toy_prefix|0", lm_eval_include_path=include_dir)
    with pytest.raises(UnsupportedTaskError, match=r"lm-eval task 'nano_toy_prefix' begins the assistant's answer "
                                                   r"itself \(gen_prefix\).*Fix: leave --use-chat-template off"):
        Evaluator(chat_backend, tasks, EvalConfig(max_samples=2, progress=False, use_chat_template=True))
    Evaluator(chat_backend, tasks, EvalConfig(max_samples=2, progress=False))  # without the template: fine
