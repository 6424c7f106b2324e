"""A checkpoint's tokenizer is untrusted code: checks that bound what using it can cost, before any task text is
given to it.

The tokenizers library runs what tokenizer.json describes in Rust, where nano_eval cannot interrupt it: a
pre-tokenizer regex that backtracks costs seconds per text (or panics past Onig's retry limit), a Replace
normalizer with a 2 MB replacement turns each matching character into 2 MB (gigabytes for one text, then an abort
that ends the process without a word). So:

- `check_tokenizer_json` (the parsed file, before the library loads it): no Replace / Prepend step, in the
  normalizer, pre-tokenizer or decoder, inserts more than `MAX_INSERT_CHARS` characters (genuine ones insert one:
  "▁"), no vocabulary entry is longer than `MAX_TOKEN_CHARS` (each generated token decodes to at most that), and
  there are at most `MAX_ADDED_TOKENS` added tokens;
- `probe_tokenizer` (the loaded tokenizer): encodes a short realistic text, then a longer one (1.3k characters),
  timed: refused past PROBE_BASE_S + 100 microseconds a character, where a genuine tokenizer takes ~1 ms in all
  (nano_eval.tokenization also times every encoding of the task's texts, alone and together), and checks that text
  becomes tokens (at least one, at most `MAX_TOKENS_PER_CHAR` per character) and that decoding them gives back
  text of about that length. Any error or Rust panic is a TokenizerError (one line, exit code 2).
"""

from __future__ import annotations

from pathlib import Path

from nano_eval.checkpoints.untrusted import CheckpointFileError
from nano_eval.tokenization import TOKENIZER_FIX, TokenizerError, call_tokenizer, timed_encode

MAX_INSERT_CHARS = 256
MAX_TOKEN_CHARS = 4096
MAX_ADDED_TOKENS = 65_536  # transformers handles each in Python: 100k took 24 s to load (Llama 3: 256, Gemma 3: ~6k)
MAX_TOKENS_PER_CHAR = 4  # byte fallback: one token per UTF-8 byte
MAX_DECODED_PER_CHAR = 16
PROBE_BASE_S = 0.05  # the probe's slack over SLOW_PER_CHAR_S a character (a genuine tokenizer: ~1 ms in all)
_INSERTS = {"Replace": "content", "Prepend": "prepend"}
# Realistic text: words, digits, punctuation, a few non-ASCII letters; the short text is its first line.
PROBE_SHORT = "Question: What is 12 plus 30?\nAnswer: 42.\n"
PROBE_LONG = (PROBE_SHORT + "The quick brown fox jumps over the lazy dog; Élodie's café serves crème brûlée for "
              "3.14 € (naïve, isn't it?) in Straße 7, 東京.\n") * 8


def check_tokenizer_json(data: dict, path: Path) -> None:
    """CheckpointFileError when the parsed tokenizer.json inserts or holds strings no genuine tokenizer does."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            field = _INSERTS.get(node.get("type"))
            value = node.get(field) if field else None
            if isinstance(value, str) and len(value) > MAX_INSERT_CHARS:
                raise CheckpointFileError(path, f"has a {node['type']} step that inserts {len(value):,} characters "
                                          f"(genuine tokenizers insert one or two; more than {MAX_INSERT_CHARS} "
                                          "would multiply every text)", TOKENIZER_FIX.removeprefix("Fix: ")[:-1])
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    vocab = model.get("vocab")
    pieces = vocab.keys() if isinstance(vocab, dict) else (v[0] for v in vocab if isinstance(v, list) and v) \
        if isinstance(vocab, list) else ()
    added_tokens = data.get("added_tokens") if isinstance(data.get("added_tokens"), list) else []
    if len(added_tokens) > MAX_ADDED_TOKENS:
        raise CheckpointFileError(path, f"adds {len(added_tokens):,} tokens to its vocabulary (genuine tokenizers add "
                                  f"hundreds to thousands; loading more than {MAX_ADDED_TOKENS:,} takes minutes)",
                                  TOKENIZER_FIX.removeprefix("Fix: ")[:-1])
    added = (t.get("content") for t in added_tokens if isinstance(t, dict))
    longest = max((len(p) for p in (*pieces, *added) if isinstance(p, str)), default=0)
    if longest > MAX_TOKEN_CHARS:
        raise CheckpointFileError(path, f"has a token of {longest:,} characters (genuine vocabularies stay under "
                                  f"{MAX_TOKEN_CHARS})", TOKENIZER_FIX.removeprefix("Fix: ")[:-1])


def probe_tokenizer(tokenizer, name: str) -> None:
    """TokenizerError unless the tokenizer turns realistic text into a sane number of tokens, and back, fast."""
    for text in (PROBE_SHORT, PROBE_LONG):
        ids = timed_encode(tokenizer, text, name, base_s=PROBE_BASE_S, add_special_tokens=False)
        if not ids:
            raise TokenizerError(f"tokenizer {name} turns the text {text[:40]!r}... into no tokens (a normalizer "
                                 f"that removes everything?). {TOKENIZER_FIX}")
        if len(ids) > MAX_TOKENS_PER_CHAR * len(text):
            raise TokenizerError(f"tokenizer {name} turns {len(text)} characters into {len(ids)} tokens (a "
                                 f"normalizer that expands text?). {TOKENIZER_FIX}")
        decoded = call_tokenizer(name, "decoding", tokenizer.decode, ids)
        if not isinstance(decoded, str) or len(decoded) > MAX_DECODED_PER_CHAR * len(text):
            raise TokenizerError(f"tokenizer {name} decodes {len(ids)} tokens of a {len(text)}-character text into "
                                 f"{len(decoded) if isinstance(decoded, str) else type(decoded).__name__} "
                                 f"characters. {TOKENIZER_FIX}")
