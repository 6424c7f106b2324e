"""Text normalisers and log-prob normalisations under lighteval's names, for ported lighteval task files.

Text normalisers map a prediction or gold string to the form that is compared (`ExactMatches(normalize_pred=...)`).
The `LogProb*Norm` records choose how multiple-choice log-probs are normalised before the argmax
(`LoglikelihoodAcc(logprob_normalization=...)`): per character, per token, or minus the unconditioned log-prob (PMI).
Written for nano_eval after lighteval's documented behaviour (helm: QuAC scorer; math: Hendrycks' MATH scorer).
"""

from __future__ import annotations

import re
import string
import unicodedata
from dataclasses import dataclass
from typing import Callable

from nano_eval.tasks.languages import Language

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def helm_normalizer(text: str) -> str:
    """HELM / QuAC: per space- or hyphen-separated word: lowercase, drop punctuation, numbers as floats ("1" ->
    "1.0"), drop articles; then single spaces."""

    def word(w: str) -> str:
        w = "".join(ch for ch in w.lower() if ch not in _PUNCT)
        try:
            w = str(float(w))
        except ValueError:
            pass
        return " ".join(_ARTICLES.sub(" ", w).split())

    return " ".join(w for w in (word(t) for t in re.split(" |-", text)) if w).strip()


def harness_triviaqa_normalizer(text: str) -> str:
    """lm-eval's TriviaQA: lowercase, no ASCII punctuation."""
    return text.lower().translate(str.maketrans("", "", string.punctuation))


def bigbench_normalizer(text: str) -> str:
    return text.replace(" . ", ".\n")


def remove_braces(text: str) -> str:
    """One leading "{" and one trailing "}" removed."""
    text = text[1:] if text.startswith("{") else text
    return text[:-1] if text.endswith("}") else text


def remove_braces_and_strip(text: str) -> str:
    return remove_braces(text.strip())


def gsm8k_normalizer(text: str) -> str:
    """The number after "#### " (commas dropped), else "[invalid]" (OpenAI grade-school-math)."""
    found = re.search(r"#### (\-?[0-9\.\,]+)", text)
    return found.group(1).strip().replace(",", "") if found else "[invalid]"


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    if text.startswith("\\boxed ", start):
        return text[start + len("\\boxed "):].split("$")[0]
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1:i]
    return None


def _fix_fracs(text: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{b} -> \frac{1}{b}."""
    head, *parts = text.split("\\frac")
    out = head
    for part in parts:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
        elif part[1] == "{":
            out += "{" + part[0] + "}" + part[1:]
        else:
            out += "{" + part[0] + "}{" + part[1] + "}" + part[2:]
    return out


def _fix_sqrt(text: str) -> str:
    r"""\sqrt3 -> \sqrt{3}."""
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", text)


def math_normalizer(text: str) -> str:
    """Hendrycks' MATH answer normalisation: the last \\boxed{} content if any, then spacing, units, degree signs,
    dollar and percent signs, `x = ` prefixes, leading-zero decimals, \\frac / \\sqrt spellings and a/b fractions
    are put into one canonical form."""
    boxed = _last_boxed(text)
    text = (boxed if boxed is not None else text).replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "").replace("$", "")
    text = re.sub(r"\\text\{\s*[^}]*\}\s*$", "", text).strip()  # trailing units
    text = text.replace("\\%", "").replace("%", "").replace(" .", " 0.").replace("{.", "{0.")
    if text.startswith("."):
        text = "0" + text
    if text.count("=") == 1 and len(text.split("=")[0]) <= 2:
        text = text.split("=")[1]
    text = _fix_fracs(_fix_sqrt(text).replace(" ", ""))
    if text == "0.5":
        text = "\\frac{1}{2}"
    fraction = re.fullmatch(r"(-?\d+)/(\d+)", text)
    return f"\\frac{{{fraction.group(1)}}}{{{fraction.group(2)}}}" if fraction else text


# Articles dropped before comparing answers (whole words, after lower-casing is not assumed: both cases listed
# where they are usual). Languages without articles, or not listed, keep their text.
ARTICLES = {
    Language.ENGLISH: ("a", "an", "the"),
    Language.FRENCH: ("le", "la", "les", "l'", "un", "une", "des"),
    Language.GERMAN: ("der", "die", "das", "den", "dem", "des", "ein", "eine", "einen", "einem", "einer", "eines"),
    Language.SPANISH: ("el", "la", "los", "las", "un", "una", "unos", "unas"),
    Language.ITALIAN: ("il", "lo", "la", "i", "gli", "le", "un", "uno", "una"),
    Language.PORTUGUESE: ("o", "a", "os", "as", "um", "uma", "uns", "umas"),
    Language.DUTCH: ("de", "het", "een"),
}
# Scripts written without spaces between words: compared character by character.
CHARACTER_LANGUAGES = {Language.CHINESE, Language.CHINESE_TRADITIONAL, Language.CHINESE_HONG_KONG, Language.JAPANESE,
                       Language.THAI, Language.LAO, Language.KHMER, Language.BURMESE, Language.TIBETAN}


def remove_punc(text: str) -> str:
    """Every Unicode punctuation character (categories P*) and ASCII punctuation (which has symbols like "$")
    removed."""
    return "".join(ch for ch in text if ch not in _PUNCT and not unicodedata.category(ch).startswith("P"))


def remove_articles(text: str, lang: Language) -> str:
    """The language's articles (ARTICLES) removed as whole words, any case; other languages unchanged."""
    words = ARTICLES.get(lang)
    if not words:
        return text
    return re.sub(r"\b(" + "|".join(re.escape(w) for w in words) + r")\b", " ", text, flags=re.IGNORECASE)


def get_multilingual_normalizer(lang: Language, lower: bool = True) -> Callable[[str], str]:
    """lighteval's language-aware answer normaliser: articles, then punctuation, removed; lower-cased; words joined
    by single spaces. Words are split on whitespace, or are single characters for languages written without spaces
    (CHARACTER_LANGUAGES); lighteval's word tokenizers (spaCy, jieba, ...) are not used."""

    def normalize(text: str) -> str:
        text = remove_punc(remove_articles(text, lang))
        text = text.lower() if lower else text
        tokens = [ch for ch in text if not ch.isspace()] if lang in CHARACTER_LANGUAGES else text.split()
        return " ".join(tokens)

    normalize.__name__ = f"multilingual_normalizer_{lang.value}"
    return normalize


@dataclass
class LogProbCharNorm:
    """Log-prob per character of the choice; `ignore_first_space` leaves out a leading space (lm-eval's acc_norm)."""

    name: str = "norm"
    ignore_first_space: bool = False


@dataclass
class LogProbTokenNorm:
    """Log-prob per token of the choice."""

    name: str = "norm_token"


@dataclass
class LogProbPMINorm:
    """log P(choice | query) - log P(choice | unconditioned query)."""

    name: str = "norm_pmi"


def normalize_log_probs(normalization, logprobs: list[float], unconditioned: list[float] | None,
                        choices: list[str], token_counts: list[int]) -> list[float]:
    """Per-choice scores whose argmax is the prediction under `normalization` (None: the raw log-probs)."""
    match normalization:
        case None:
            return list(logprobs)
        case LogProbCharNorm(ignore_first_space=True):
            return [lp / (len(c) - 1 if c.startswith(" ") else len(c)) for lp, c in zip(logprobs, choices)]
        case LogProbCharNorm():
            return [lp / len(c) for lp, c in zip(logprobs, choices)]
        case LogProbTokenNorm():
            return [lp / n for lp, n in zip(logprobs, token_counts)]
        case LogProbPMINorm():
            return [lp - u for lp, u in zip(logprobs, unconditioned)]
    raise ValueError(f"unknown logprob_normalization {normalization!r}; use LogProbCharNorm(), LogProbTokenNorm() "
                     "or LogProbPMINorm()")
