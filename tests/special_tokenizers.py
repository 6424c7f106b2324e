"""Toy checkpoints whose tokenizers add special tokens as Llama's do, built locally with `tokenizers` (no download).

One tiny untrained Llama (nano_eval.toy.build_model) saved once; each variant is a folder holding the same weights
(hard links) and its own tokenizer: the toy BPE tokenizer plus `<s>` (bos_token) and `</s>` (eos_token), and

    "bos"      post-processor "<s> $A": BOS before every text (Llama 2, Mistral, Gemma)
    "bos_eos"  post-processor "<s> $A </s>": BOS before and EOS after (Llama with add_eos_token=True)
    "plain"    no post-processor: defines bos_token but adds nothing (GPT-2 / SmolLM style)
"""

from __future__ import annotations

import os
from pathlib import Path

TEMPLATES = {"bos": "<s> $A", "bos_eos": "<s> $A </s>", "plain": None}


def build_special_checkpoints(root: str | Path, seed: int = 0) -> dict[str, Path]:
    """{variant: checkpoint folder} under `root`."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from nano_eval.toy import build_model, build_tokenizer

    root = Path(root)
    plain = build_tokenizer()
    plain.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>"})
    plain.pad_token = plain.eos_token
    plain.save_pretrained(root / "plain")
    build_model(len(plain), seed=seed).save_pretrained(root / "weights")
    out = {}
    for kind, single in TEMPLATES.items():
        folder = root / kind
        folder.mkdir(exist_ok=True)
        if single is not None:
            tok = AutoTokenizer.from_pretrained(root / "plain")
            specials = [(t, tok.convert_tokens_to_ids(t)) for t in ("<s>", "</s>") if t in single]
            tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
                single=single, pair=f"{single} {single.replace('$A', '$B')}", special_tokens=specials)
            tok.save_pretrained(folder)
        for f in (root / "weights").iterdir():
            os.link(f, folder / f.name)
        out[kind] = folder
    return out
