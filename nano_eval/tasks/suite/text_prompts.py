"""Prompt functions of the suite's text tasks: LAMBADA (last word), GSM8K (generation), WikiText (perplexity).

In the docstrings `|` separates the query from the scored continuation or reference, and `{x}` is a row field.
"""

from __future__ import annotations

import re

from nano_eval.tasks.requests import Doc


def lambada(line: dict, task_name: str) -> Doc:
    """`{text without its last word}` | ` {last word}` (lm-eval's lambada_openai: split at the last space)."""
    context, word = line["text"].rsplit(" ", 1)
    return Doc(task_name=task_name, query=context, choices=[" " + word], gold_index=0)


def gsm8k(line: dict, task_name: str) -> Doc:
    """`Question: {question}\\nAnswer:` | ` {answer}` (lm-eval's gsm8k). The reference is the full worked solution
    ending in `#### {number}`: few-shot examples show it, and `gsm8k_match` compares the number after "####"
    with the number the model's answer ends on."""
    return Doc(task_name=task_name, query=f"Question: {line['question']}\nAnswer:", choices=[" " + line["answer"]],
               gold_index=0)


# WikiText is stored tokenised (" @-@ ", " , ", "( x )"); scoring that spelling would measure the tokeniser, not
# the model. Rules applied in order; the result is lm-eval's wikitext text.
_JOINS = [("s '", "s'"), (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),
          (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", ")]
_PAIRS = [(re.compile(re.escape(o) + r"\s*([^" + re.escape(c) + r"]*?)\s*" + re.escape(c)), o + r"\1" + c)
          for o, c in [("(", ")"), ("[", "]"), ("{", "}"), ('"', '"'), ("'", "'")]]
_TIDY = [("= = = =", "===="), ("= = =", "==="), ("= =", "=="), (" \u00b0 ", "\u00b0"), (" \n", "\n"), ("\n ", "\n"),
         (" N ", " 1 "), (" 's", "'s")]


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's tokenisation: rejoin numbers and punctuation, tighten brackets and quotes, headings."""
    for old, new in _JOINS:
        text = text.replace(old, new)
    for pattern, joined in _PAIRS:
        text = pattern.sub(joined, text)
    for old, new in _TIDY:
        text = text.replace(old, new)
    return text


def wikitext(line: dict, task_name: str) -> Doc | None:
    """`{page}` detokenised (`wikitext_detokenize`), scored whole with rolling windows; empty pages are skipped.
    word/byte counts are those of the scored (detokenised) text; lm-eval counts the raw page instead."""
    text = wikitext_detokenize(line["page"])
    return Doc(task_name=task_name, query=text, choices=[], gold_index=0) if text.strip() else None
