"""Text -> token ids: the one tokenisation rule every request type uses, lm-evaluation-harness 0.4.13's (hf model).

`add_bos_token` decides which special tokens go before a context (lm-eval's `add_bos_token` model argument):

    None   the tokenizer's own choice (lm-eval's default): the special tokens its `encode` puts before a text.
           Llama 2/3, Mistral, Gemma: BOS. GPT-2, SmolLM, Qwen: nothing.
    True   BOS before every context (the tokenizer must have a BOS token).
    False  no special token at all.

Rules (one method each below):
- context: those prefix tokens + the text's own tokens; no prefix when the text already starts with the BOS
  string (lm-eval: the prompt carries its own BOS).
- continuation: the tokens that encoding context + continuation adds after the context's own tokens (trailing
  spaces of the context move to the continuation first); never a special token. Special tokens a tokenizer
  *appends* (EOS, Llama's `add_eos_token=True`) are never used: lm-eval 0.4.13 keeps them and then splits
  `whole[len(context):]` one token off (an EOS inside the context, the continuation's first token dropped).
- empty context: `prefix_id` (BOS, else EOS) conditions the continuation, unless the continuation's own first
  token is that id (lm-eval).
- rolling windows: the text's context tokens are scored, the first window conditioned on `prefix_id`, as lm-eval
  does. With a tokenizer that adds BOS (add_bos_token None or True), that BOS is the first scored token, after a
  BOS prefix; lm-eval 0.4.13 counts it too.
- generation prompt: the context tokens ([prefix_id] for an empty prompt); any of `eos_ids` (the tokenizer's EOS
  and every id of the model's `generation_config.eos_token_id`, a list for Llama 3) ends the generation.

A tokenizer is untrusted input (it comes with the checkpoint): every call into it goes through `call_tokenizer`,
which turns what it raises, a Rust panic included, into a TokenizerError (one line, exit code 2), and every
encoding is timed: one that takes longer than `SLOW_BASE_S` + `SLOW_PER_CHAR_S` per character (a pre-tokenizer
regex that backtracks) is refused instead of running for hours over a task's texts. Checks before use:
nano_eval.checkpoints.tokenizer_probe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from nano_eval.errors import NanoEvalError, is_rust_panic

PROBE_TEXT = "Hello world"  # any text: encoded with and without special tokens to find what the tokenizer adds
# A genuine fast tokenizer encodes a character in about a microsecond, plus ~50 microseconds a call. Allowed: 100x
# that per character, with slack for a busy machine or a garbage-collector pause: one call may take SLOW_BASE_S
# more, all calls together SLOW_TOTAL_S more (and SLOW_PER_CALL_S a call).
SLOW_PER_CHAR_S = 100e-6
SLOW_BASE_S = 2.0
SLOW_TOTAL_S = 10.0
SLOW_PER_CALL_S = 1e-3
TOKENIZER_FIX = ("Fix: use the tokenizer the model was trained with (--tokenizer PATH_OR_HUB_ID), or restore the "
                 "checkpoint's tokenizer files from the run that saved it.")


class TokenizerError(NanoEvalError):
    """A tokenizer that fails, panics or is too slow on a text: one line naming it and the fix."""


def call_tokenizer(name: str, what: str, fn: Callable, *args, **kwargs):
    """fn(*args, **kwargs) (`what` the tokenizer does, for the message), with every error it raises, a Rust panic
    (a BaseException) included, turned into a TokenizerError naming tokenizer `name`."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, SystemExit, GeneratorExit, NanoEvalError):
        raise
    except BaseException as e:  # noqa: BLE001 -- pyo3's PanicException derives from BaseException
        if not isinstance(e, Exception) and not is_rust_panic(e):
            raise
        kind = "panics" if is_rust_panic(e) else "fails"
        raise TokenizerError(f"tokenizer {name} {kind} when {what} ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}). {TOKENIZER_FIX}") from None


def decode_text(tokenizer, ids: list[int]) -> str:
    """The text of generated token ids, special tokens left out (a Rust panic: a TokenizerError)."""
    return call_tokenizer(_name(tokenizer), "decoding", tokenizer.decode, ids, skip_special_tokens=True)


class EncodeBudget:
    """The time all encodings of one tokenizer took, against what a genuine tokenizer could take for as many
    characters and calls: a tokenizer a little too slow on every text (which each call's own limit lets through)
    is refused once it has cost SLOW_TOTAL_S more than that, not after hours of a task's texts."""

    def __init__(self):
        self.seconds, self.chars, self.calls = 0.0, 0, 0

    def charge(self, seconds: float, chars: int) -> bool:
        """Count one encoding; False when the total is past the allowance."""
        self.seconds, self.chars, self.calls = self.seconds + seconds, self.chars + chars, self.calls + 1
        return self.seconds <= SLOW_TOTAL_S + SLOW_PER_CHAR_S * self.chars + SLOW_PER_CALL_S * self.calls


def timed_encode(tokenizer, text: str, name: str | None = None, budget: EncodeBudget | None = None,
                 base_s: float = SLOW_BASE_S, **kwargs) -> list[int]:
    """tokenizer.encode(text, **kwargs) through call_tokenizer, refused when it took longer than a genuine
    tokenizer ever does for a text this long (`base_s` + SLOW_PER_CHAR_S a character), or when the encodings
    `budget` counts took longer together."""
    name = name or _name(tokenizer)
    start = time.perf_counter()
    ids = call_tokenizer(name, f"encoding a text of {len(text)} characters", tokenizer.encode, text, **kwargs)
    elapsed = time.perf_counter() - start
    if elapsed > base_s + SLOW_PER_CHAR_S * len(text):
        spent = f"{elapsed:.2f}s to encode a text of {len(text)} characters"
    elif budget is not None and not budget.charge(elapsed, len(text)):
        spent = f"{budget.seconds:.1f}s to encode {budget.calls} texts of {budget.chars} characters in all"
    else:
        return ids
    raise TokenizerError(f"tokenizer {name} took {spent} (a genuine tokenizer takes about a microsecond a "
                         f"character; a pre-tokenizer or normalizer regex that backtracks?). {TOKENIZER_FIX}")


@dataclass(frozen=True)
class Tokenization:
    """How text becomes token ids for one tokenizer and one `add_bos_token` setting. Build with `Tokenization.of`.

    prefix:     special-token ids put before every context (empty, or (BOS,))
    prefix_id:  the token that conditions an empty context and the first rolling window (BOS, else EOS)
    eos_ids:    token ids that end a generation
    """

    tokenizer: Any
    prefix: tuple[int, ...]
    prefix_id: int
    eos_ids: frozenset[int]
    budget: EncodeBudget = field(default_factory=EncodeBudget, compare=False, repr=False)

    @classmethod
    def of(cls, tokenizer, add_bos_token: bool | None = None, generation_config: Any = None) -> Tokenization:
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        if add_bos_token is None:
            prefix = _default_prefix(tokenizer)
        elif add_bos_token:
            if bos is None:
                raise NanoEvalError(
                    f"add_bos_token=True, but tokenizer {_name(tokenizer)} has no BOS token. Fix: leave add_bos_token "
                    "unset (the tokenizer's own choice) or use a tokenizer that defines bos_token."
                )
            prefix = (bos,)
        else:
            prefix = ()
        prefix_id = bos if bos is not None else eos
        if prefix_id is None:
            raise NanoEvalError(f"tokenizer {_name(tokenizer)} has neither a BOS nor an EOS token; nano_eval needs one "
                                "to condition empty contexts. Fix: set tokenizer.eos_token.")
        return cls(tokenizer, prefix, prefix_id, _eos_ids(eos, generation_config))

    def text(self, text: str) -> list[int]:
        """The text's own tokens, no special token added."""
        return timed_encode(self.tokenizer, text, budget=self.budget, add_special_tokens=False)

    def context(self, text: str) -> list[int]:
        """A context (prompt, rolling document): the prefix, then the text's tokens."""
        if self.prefix and text.startswith(self._prefix_string):
            return self.text(text)
        return list(self.prefix) + self.text(text)

    def pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens) for a loglikelihood request, split as lm-eval splits them."""
        if not context:
            cont = self.text(continuation)
            if cont and cont[0] == self.prefix_id:
                return cont[:1], cont[1:]
            return [self.prefix_id], cont
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        ctx = self.context(context)
        whole = self.context(context + continuation)
        return ctx, whole[len(ctx):]

    def prompt(self, text: str) -> list[int]:
        """A generation prompt's tokens (never empty)."""
        return self.context(text) or [self.prefix_id]

    @property
    def _prefix_string(self) -> str:
        return call_tokenizer(_name(self.tokenizer), "decoding", self.tokenizer.decode, [self.prefix_id])


def _default_prefix(tokenizer) -> tuple[int, ...]:
    """The special tokens the tokenizer's `encode` puts before a text by default (lm-eval's add_bos_token=None)."""
    with_specials = timed_encode(tokenizer, PROBE_TEXT)
    plain = timed_encode(tokenizer, PROBE_TEXT, add_special_tokens=False)
    for start in range(len(with_specials) - len(plain) + 1):
        if with_specials[start:start + len(plain)] == plain:
            return tuple(with_specials[:start])
    raise NanoEvalError(
        f"tokenizer {_name(tokenizer)}: encoding {PROBE_TEXT!r} with special tokens ({with_specials}) does not contain "
        f"its tokens without them ({plain}), so nano_eval cannot tell which special tokens it adds. Fix: set "
        "add_bos_token (--add-bos-token / --no-add-bos-token) explicitly."
    )


def _eos_ids(eos: int | None, generation_config: Any) -> frozenset[int]:
    """The tokenizer's EOS and the model's generation_config.eos_token_id (an id or a list of ids; checked: the
    file comes with the checkpoint)."""
    ids = {eos} if eos is not None else set()
    extra = getattr(generation_config, "eos_token_id", None)
    listed = extra if isinstance(extra, (list, tuple)) else [] if extra is None else [extra]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in listed):
        raise NanoEvalError(f"the model's generation_config.json has eos_token_id={extra!r:.100}, not a token id or "
                            "a list of token ids. Fix: correct eos_token_id in the checkpoint's "
                            "generation_config.json (or remove it: the tokenizer's EOS is used).")
    ids.update(listed)
    return frozenset(ids)


def _name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def chat_renderer(tokenizer) -> Callable[[list[dict]], str]:
    """messages -> prompt text with the tokenizer's own chat template, ending with the assistant's turn opener
    (`add_generation_prompt=True`, as lighteval and lm-eval do), rendered as transformers renders it but with a
    bounded budget (nano_eval.chat_template). NanoEvalError when the tokenizer has no template or it does not
    compile."""
    from nano_eval.chat_template import ChatTemplate

    if not getattr(tokenizer, "chat_template", None):
        raise NanoEvalError(
            f"--use-chat-template (use_chat_template=True) needs a chat template, but tokenizer {_name(tokenizer)} has "
            "none. Fix: leave the option off for a base model, or use the instruct model's tokenizer (its "
            "tokenizer_config.json carries `chat_template`).")
    try:
        source = tokenizer.get_chat_template()
    except Exception as e:  # noqa: BLE001 -- a dict of named templates without a default one, a non-string
        raise NanoEvalError(f"tokenizer {_name(tokenizer)}: its chat template cannot be used "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:200]}). Fix: use a tokenizer whose "
                            "tokenizer_config.json carries one `chat_template` string.") from None
    if not isinstance(source, str):
        raise NanoEvalError(f"tokenizer {_name(tokenizer)}: its chat template is a {type(source).__name__}, not "
                            "text. Fix: use a tokenizer whose tokenizer_config.json carries one `chat_template` "
                            "string.")
    return ChatTemplate(source, _name(tokenizer), dict(tokenizer.special_tokens_map)).render
