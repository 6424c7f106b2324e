"""The README's Python blocks run as written.

Every ```python block of README.md is executed, in its own namespace, on the toy model (nano_eval/toy.py), except a
block whose fence is preceded by a line `<!-- not run: WHY -->` (it needs something a test cannot hold: a live
nanotron trainer, Megatron's `pretrain`). A block may use the names a training script would already hold; the test
provides them (README_NAMES): `model` and `tokenizer` (the toy transformers model and its tokenizer), `start` and
`num_steps` (a loop over steps 0..2), `train_step` (does nothing) and `tokens_so_far` (0). W&B is disabled
(WANDB_MODE=disabled) and each block runs in a fresh temporary working folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NOT_RUN = re.compile(r"^<!-- not run: .+ -->$")


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """(line of the fence, code, runs) of every ```python block; `runs` is False after a `<!-- not run: ... -->` line."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            runs = not (start > 0 and NOT_RUN.match(lines[start - 1].strip()))
            blocks.append((start + 1, "\n".join(lines[start + 1:end]) + "\n", runs))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_blocks_that_are_not_run_say_why():
    assert any(runs for _, _, runs in BLOCKS) and any(not runs for _, _, runs in BLOCKS)


@pytest.fixture(scope="module")
def readme_names(toy_checkpoint):
    """README_NAMES: what a block may assume a training script already holds."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return {"model": AutoModelForCausalLM.from_pretrained(toy_checkpoint),
            "tokenizer": AutoTokenizer.from_pretrained(toy_checkpoint),
            "start": 0, "num_steps": 2, "train_step": lambda: None, "tokens_so_far": 0}


@pytest.mark.parametrize("line, code", [(line, code) for line, code, runs in BLOCKS if runs],
                         ids=[f"README.md:{line}" for line, _, runs in BLOCKS if runs])
def test_readme_block_runs(line, code, readme_names, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "readme_block", **readme_names})
