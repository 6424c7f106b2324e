"""A toy checkpoint built in seconds: a small BPE tokenizer and a tiny Llama, for the demo and the tests.

Nothing is downloaded. The tokenizer is trained on a fixed text, the weights come from a fixed seed, and an
optional few hundred training steps on synthetic arithmetic make the demo's scores move off chance.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from nano_eval.tracking.files import current_umask

WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are or which one two three four five "
    "six seven eight nine ten plus minus equals answer question man woman dog cat runs walks sits eats drinks "
    "house roof car tree water food sun moon red blue green big small happy sad fast slow yes no true false "
    "because then when where what who how why before after"
).split()


def corpus(seed: int = 0, n: int = 2000) -> list[str]:
    """Deterministic training text for the tokenizer: word salad plus the arithmetic facts of the demo task."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "." for _ in range(n)]
    lines += [arithmetic_line(a, b) for a in range(10) for b in range(10)]
    return lines


def arithmetic_line(a: int, b: int) -> str:
    return f"Question: {a} plus {b}\nAnswer: {a + b}"


def build_tokenizer(vocab_size: int = 600):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token=None)


def build_model(vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2, max_len: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def train_on_arithmetic(model, tokenizer, steps: int, seed: int = 0) -> None:
    """A few optimizer steps on arithmetic facts, alone or several in a row as few-shot prompts show them, so the
    demo's scores are above chance at 0 and at k shots."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        lines = [
            "\n\n".join(arithmetic_line(rng.randrange(10), rng.randrange(10)) for _ in range(rng.randint(1, 4)))
            for _ in range(32)
        ]
        enc = tokenizer(lines, return_tensors="pt", padding=True)
        labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def build_toy_checkpoint(path: str | Path, *, seed: int = 0, train_steps: int = 0) -> Path:
    """Save a toy transformers checkpoint (safetensors) to `path` and return it."""
    path = Path(path)
    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    model = build_model(len(tokenizer), seed=seed)
    if train_steps:
        train_on_arithmetic(model, tokenizer, train_steps, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    mode = 0o666 & ~current_umask()  # transformers writes the weights 0600 (a temporary file renamed)
    for f in path.rglob("*"):
        if f.is_file():
            f.chmod(mode)
    return path


def write_arithmetic_task_data(path: str | Path) -> Path:
    """The demo's multiple-choice data: 'a plus b' with four candidate sums, as jsonl."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(1)
    with path.open("w") as f:
        for a in range(10):
            for b in range(10):
                wrong = rng.sample([s for s in range(19) if s != a + b], 3)
                choices = [a + b] + wrong
                rng.shuffle(choices)
                row = {"a": a, "b": b, "choices": [str(c) for c in choices], "label": choices.index(a + b)}
                f.write(json.dumps(row) + "\n")
    return path
