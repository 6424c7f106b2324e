"""--use-chat-template / --system-prompt: contexts rendered by the tokenizer's own chat template (a local tokenizer
carrying one), recorded in results.json and the evaluation identity, and a clear exit 2 without a template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nano_eval.cli import main
from nano_eval.evaluator import EvalConfig
from nano_eval.job import EvalJob
from nano_eval.sweep.identity import evaluation_identity
from nano_eval.tasks import Registry, build_requests
from nano_eval.tokenization import chat_renderer

# A ChatML-like template whose turns end with the toy tokenizer's one special token.
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")
SYSTEM = "Add the two numbers."


def turn(role: str, content: str) -> str:
    return f"<|endoftext|>{role}\n{content}\n"


@pytest.fixture(scope="module")
def chat_checkpoint(toy_checkpoint, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(toy_checkpoint, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


def test_few_shot_context_is_a_conversation(chat_checkpoint):
    from transformers import AutoTokenizer

    render = chat_renderer(AutoTokenizer.from_pretrained(str(chat_checkpoint)))
    task = Registry().get_task_instance("demo|arithmetic_gen")
    docs, requests = build_requests(task, 2, max_samples=3, system_prompt=SYSTEM, chat=render)
    examples = task.prompt_manager(2).fewshot_examples(docs[1], 1, 2)
    expected = turn("system", SYSTEM) + "".join(
        turn("user", ex.query) + turn("assistant", ex.choices[0].strip()) for ex in examples)
    assert requests[1].context == expected + turn("user", docs[1].query) + "<|endoftext|>assistant\n"
    plain = build_requests(task, 0, max_samples=1, system_prompt=SYSTEM)[1][0].context
    assert plain == f"{SYSTEM}\n\n{docs[0].query}"
    assert build_requests(task, 0, max_samples=1)[1][0].context == docs[0].query  # off by default


def test_cli_scores_with_the_template_and_records_it(chat_checkpoint, tmp_path):
    out = tmp_path / "out"
    assert main(["--checkpoint", str(chat_checkpoint), "--tasks", "demo|arithmetic|0,demo|arithmetic_gen|0",
                 "--max-samples", "3", "--use-chat-template", "--system-prompt", SYSTEM,
                 "--output-dir", str(out)]) == 0
    config = json.loads((out / "results.json").read_text())["config"]
    assert (config["use_chat_template"], config["system_prompt"]) == (True, SYSTEM)
    details = [json.loads(line) for line in next((out / "details").glob("*arithmetic_gen*")).read_text().splitlines()]
    query = "Question: 0 plus 0\nAnswer:"  # the demo file's first row
    assert details[0]["context"] == turn("system", SYSTEM) + turn("user", query) + "<|endoftext|>assistant\n"
    assert "predictions" in details[0]


def test_without_a_template_exit_2_names_the_fix(toy_checkpoint, tmp_path, capsys):
    assert main(["--checkpoint", str(toy_checkpoint), "--tasks", "demo|arithmetic|0", "--max-samples", "2",
                 "--use-chat-template", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nano_eval: error: --use-chat-template" in err and "has none" in err and "chat_template" in err


def test_template_and_system_prompt_are_part_of_the_identity():
    def identity(**kw):
        return evaluation_identity(EvalJob(tasks="demo|arithmetic|0", eval=EvalConfig(**kw)), ["demo|arithmetic|0"],
                                   {"demo|arithmetic|0": 0}, "fp")

    assert len({identity(), identity(use_chat_template=True), identity(system_prompt="x")}) == 3
