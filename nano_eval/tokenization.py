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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from nano_eval.errors import NanoEvalError

PROBE_TEXT = "Hello world"  # any text: encoded with and without special tokens to find what the tokenizer adds


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
        return self.tokenizer.encode(text, add_special_tokens=False)

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
        return self.tokenizer.decode([self.prefix_id])


def _default_prefix(tokenizer) -> tuple[int, ...]:
    """The special tokens the tokenizer's `encode` puts before a text by default (lm-eval's add_bos_token=None)."""
    with_specials = tokenizer.encode(PROBE_TEXT)
    plain = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    for start in range(len(with_specials) - len(plain) + 1):
        if with_specials[start:start + len(plain)] == plain:
            return tuple(with_specials[:start])
    raise NanoEvalError(
        f"tokenizer {_name(tokenizer)}: encoding {PROBE_TEXT!r} with special tokens ({with_specials}) does not contain "
        f"its tokens without them ({plain}), so nano_eval cannot tell which special tokens it adds. Fix: set "
        "add_bos_token (--add-bos-token / --no-add-bos-token) explicitly."
    )


def _eos_ids(eos: int | None, generation_config: Any) -> frozenset[int]:
    ids = {eos} if eos is not None else set()
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(i) for i in extra)
    return frozenset(ids)


def _name(tokenizer) -> str:
    return repr(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def chat_renderer(tokenizer) -> Callable[[list[dict]], str]:
    """messages -> prompt text with the tokenizer's own chat template, ending with the assistant's turn opener
    (`add_generation_prompt=True`, as lighteval and lm-eval do). NanoEvalError when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise NanoEvalError(
            f"--use-chat-template (use_chat_template=True) needs a chat template, but tokenizer {_name(tokenizer)} has "
            "none. Fix: leave the option off for a base model, or use the instruct model's tokenizer (its "
            "tokenizer_config.json carries `chat_template`).")

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render
