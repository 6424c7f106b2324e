"""lighteval's prompt templates (`lighteval.tasks.templates`), for its multilingual task files.

A template is a factory: `get_mcq_prompt_function(Language.FRENCH, adapter, MCFFormulation())` returns a prompt
function `(line, task_name) -> Doc`. The adapter maps a dataset row to the template's input (a function returning a
dict, or a dict {input key: row column}). The formulation chooses how choices are shown and scored:

- `CFFormulation()` (cloze): no options in the query; each answer text is a choice (" Paris").
- `MCFFormulation(choice_prefix)`: options listed as " A. Paris"; the choices are the letters (" A").
- `HybridFormulation(choice_prefix)`: options listed; the choices are the answer texts.

The words put around the question ("Question", "Answer", "yes", "because", punctuation and spacing) come from
`TRANSLATION_LITERALS[language]`. nano_eval ships its own words for a few languages (`LITERAL_LANGUAGES`; English as
lighteval writes it, the others nano_eval's translations, which may differ from lighteval's); add a language with
`TRANSLATION_LITERALS[Language.X] = TranslationLiterals(Language.X, question_word=..., ...)` before the task file is
imported. A template for a language (or a word) without literals returns an `UnsupportedPrompt`: the file loads and
its task refuses to run, naming the language. Written for nano_eval after lighteval's documented formats; no
lighteval code is used.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from nano_eval.errors import NanoEvalError
from nano_eval.tasks.languages import Language
from nano_eval.tasks.requests import Doc


def as_list(item) -> list:
    return list(item) if isinstance(item, (list, tuple)) else [item]


# ---------------------------------------------------------------- words of each language


class MissingLiteral(AttributeError):
    """A template needs a word the language's TranslationLiterals does not give."""


@dataclass
class TranslationLiterals:
    """The words and punctuation templates put around the content, in one language (None: not given)."""

    language: Language
    question_word: str | None = None
    answer: str | None = None
    confirmation_word: str | None = None
    yes: str | None = None
    no: str | None = None
    also: str | None = None
    cause_word: str | None = None
    effect_word: str | None = None
    or_word: str | None = None
    and_word: str | None = None
    true: str | None = None
    false: str | None = None
    neither: str | None = None
    full_stop: str = "."
    comma: str = ","
    question_mark: str = "?"
    exclamation_mark: str = "!"
    word_space: str = " "
    sentence_space: str = " "
    colon: str = ":"
    semicolon: str = ";"
    indices: list[str] = field(default_factory=lambda: list(string.ascii_uppercase))

    def __getattribute__(self, name: str):
        value = super().__getattribute__(name)
        if value is None:
            raise MissingLiteral(f"no `{name}` word for {super().__getattribute__('language')}")
        return value

    def missing(self, names: tuple[str, ...]) -> list[str]:
        return [n for n in names if object.__getattribute__(self, n) is None]


def _words(language: Language, question: str, answer: str, yes: str, no: str, true: str, false: str, neither: str,
           because: str, therefore: str, or_word: str, and_word: str, also: str, right: str,
           **punctuation) -> TranslationLiterals:
    return TranslationLiterals(language, question_word=question, answer=answer, yes=yes, no=no, true=true, false=false,
                               neither=neither, cause_word=because, effect_word=therefore, or_word=or_word,
                               and_word=and_word, also=also, confirmation_word=right, **punctuation)


TRANSLATION_LITERALS: dict[Language, TranslationLiterals] = {
    Language.ENGLISH: _words(Language.ENGLISH, "question", "answer", "yes", "no", "true", "false", "neither",
                             "because", "therefore", "or", "and", "also", "right"),
    Language.FRENCH: _words(Language.FRENCH, "question", "réponse", "oui", "non", "vrai", "faux", "ni l'un ni l'autre",
                            "parce que", "donc", "ou", "et", "aussi", "n'est-ce pas"),
    Language.GERMAN: _words(Language.GERMAN, "Frage", "Antwort", "ja", "nein", "wahr", "falsch", "weder noch", "weil",
                            "deshalb", "oder", "und", "auch", "richtig"),
    Language.SPANISH: _words(Language.SPANISH, "pregunta", "respuesta", "sí", "no", "verdadero", "falso", "ninguno",
                             "porque", "por lo tanto", "o", "y", "también", "verdad"),
    Language.ITALIAN: _words(Language.ITALIAN, "domanda", "risposta", "sì", "no", "vero", "falso", "nessuno dei due",
                             "perché", "quindi", "o", "e", "anche", "giusto"),
    Language.PORTUGUESE: _words(Language.PORTUGUESE, "pergunta", "resposta", "sim", "não", "verdadeiro", "falso",
                                "nenhum", "porque", "portanto", "ou", "e", "também", "certo"),
    Language.DUTCH: _words(Language.DUTCH, "vraag", "antwoord", "ja", "nee", "waar", "onwaar", "geen van beide",
                           "omdat", "daarom", "of", "en", "ook", "toch"),
    Language.RUSSIAN: _words(Language.RUSSIAN, "вопрос", "ответ", "да", "нет", "верно", "неверно",
                             "ни то, ни другое", "потому что", "поэтому", "или", "и", "также", "верно",
                             indices=list("АБВГДЕЖЗИКЛМН")),
    Language.CHINESE: _words(Language.CHINESE, "问题", "答案", "是", "否", "正确", "错误", "都不是", "因为", "所以",
                             "或", "和", "也", "对吗", full_stop="。", comma="，", question_mark="？",
                             exclamation_mark="！", word_space="", sentence_space="", colon="：", semicolon="；"),
    Language.JAPANESE: _words(Language.JAPANESE, "質問", "答え", "はい", "いいえ", "正しい", "間違い", "どちらでもない",
                              "なぜなら", "したがって", "または", "と", "また", "ですよね", full_stop="。", comma="、",
                              question_mark="？", exclamation_mark="！", word_space="", sentence_space="", colon="：",
                              semicolon="；"),
    Language.KOREAN: _words(Language.KOREAN, "질문", "답변", "예", "아니요", "참", "거짓", "둘 다 아님", "왜냐하면",
                            "따라서", "또는", "그리고", "또한", "맞죠"),
    Language.ARABIC: _words(Language.ARABIC, "سؤال", "إجابة", "نعم", "لا", "صحيح", "خطأ", "لا هذا ولا ذاك", "لأن",
                            "لذلك", "أو", "و", "أيضا", "أليس كذلك", comma="،", question_mark="؟", semicolon="؛",
                            indices=["أ", "ب", "ج", "د", "هـ", "و", "ز", "ح"]),
    Language.PERSIAN: _words(Language.PERSIAN, "پرسش", "پاسخ", "بله", "خیر", "درست", "نادرست", "هیچکدام", "زیرا",
                             "بنابراین", "یا", "و", "همچنین", "درسته", comma="،", question_mark="؟", semicolon="؛"),
    Language.HINDI: _words(Language.HINDI, "प्रश्न", "उत्तर", "हाँ", "नहीं", "सही", "गलत", "कोई नहीं", "क्योंकि",
                           "इसलिए", "या", "और", "भी", "है ना", full_stop="।"),
    Language.BENGALI: _words(Language.BENGALI, "প্রশ্ন", "উত্তর", "হ্যাঁ", "না", "সত্য", "মিথ্যা", "কোনোটিই না", "কারণ",
                             "তাই", "অথবা", "এবং", "এছাড়াও", "তাই না", full_stop="।"),
    Language.INDONESIAN: _words(Language.INDONESIAN, "pertanyaan", "jawaban", "ya", "tidak", "benar", "salah",
                                "bukan keduanya", "karena", "oleh karena itu", "atau", "dan", "juga", "bukan"),
    Language.TURKISH: _words(Language.TURKISH, "soru", "cevap", "evet", "hayır", "doğru", "yanlış", "hiçbiri", "çünkü",
                             "bu yüzden", "veya", "ve", "ayrıca", "değil mi"),
    Language.SWAHILI: _words(Language.SWAHILI, "swali", "jibu", "ndiyo", "hapana", "kweli", "si kweli", "hakuna",
                             "kwa sababu", "kwa hiyo", "au", "na", "pia", "sivyo"),
    Language.VIETNAMESE: _words(Language.VIETNAMESE, "câu hỏi", "trả lời", "có", "không", "đúng", "sai",
                                "không cái nào", "bởi vì", "do đó", "hoặc", "và", "cũng", "phải không"),
    Language.POLISH: _words(Language.POLISH, "pytanie", "odpowiedź", "tak", "nie", "prawda", "fałsz", "żadne",
                            "ponieważ", "dlatego", "lub", "i", "również", "prawda"),
    Language.UKRAINIAN: _words(Language.UKRAINIAN, "питання", "відповідь", "так", "ні", "правда", "неправда", "жодне",
                               "тому що", "тому", "або", "і", "також", "чи не так"),
    Language.CZECH: _words(Language.CZECH, "otázka", "odpověď", "ano", "ne", "pravda", "nepravda", "ani jedno",
                           "protože", "proto", "nebo", "a", "také", "že"),
    Language.SWEDISH: _words(Language.SWEDISH, "fråga", "svar", "ja", "nej", "sant", "falskt", "ingetdera", "eftersom",
                             "därför", "eller", "och", "också", "eller hur"),
}
LITERAL_LANGUAGES = tuple(TRANSLATION_LITERALS)


class UnsupportedPrompt:
    """A prompt function nano_eval cannot build (a language without words, a template not ported): the task file
    loads; the task refuses to run with `unsupported_reason`."""

    __name__ = "unsupported_prompt"

    def __init__(self, reason: str):
        self.unsupported_reason = reason

    def __call__(self, line: dict, task_name: str | None = None):
        raise NanoEvalError(self.unsupported_reason)


def _literals(template: str, language: Language, needs: tuple[str, ...],
              adapter=None) -> TranslationLiterals | UnsupportedPrompt:
    """The language's literals, or an UnsupportedPrompt naming the language and the missing words (or the reason
    an adapter nano_eval has not ported gives)."""
    if getattr(adapter, "unsupported_reason", None):
        return UnsupportedPrompt(adapter.unsupported_reason)
    literals = TRANSLATION_LITERALS.get(language)
    fix = ("nano_eval has prompt words for " + ", ".join(lang.name.lower() for lang in TRANSLATION_LITERALS)
           + "; add others with TRANSLATION_LITERALS[Language.X] = TranslationLiterals(...)")
    if literals is None:
        return UnsupportedPrompt(f"template {template} in {language}: no prompt words for that language ({fix})")
    missing = literals.missing(needs)
    if missing:
        return UnsupportedPrompt(f"template {template} in {language}: the words {missing} are not given ({fix})")
    return literals


# ---------------------------------------------------------------- formulations and formatting


@dataclass
class MCFFormulation:
    """Options listed with prefixes ("Letters" A B C, "NativeLetters" the language's, "Numbers" 1 2 3); the
    choices are the prefixes."""

    choice_prefix: str = "Letters"
    name: str = "MCF"


@dataclass
class HybridFormulation:
    """Options listed with prefixes; the choices are the answer texts."""

    choice_prefix: str = "Letters"
    name: str = "Hybrid"


@dataclass
class CFFormulation:
    """No options listed; the choices are the answer texts (cloze)."""

    name: str = "CF"


Formulation = CFFormulation | HybridFormulation | MCFFormulation


def get_prefix(choice_prefix: str, literals: TranslationLiterals) -> list[str]:
    if choice_prefix == "Letters":
        return list(string.ascii_uppercase)
    if choice_prefix == "NativeLetters":
        return list(literals.indices)
    if choice_prefix == "Numbers":
        return [str(i) for i in range(1, 27)]
    raise ValueError(f"choice_prefix={choice_prefix!r}; use 'Letters', 'NativeLetters' or 'Numbers'")


def build_choices(choices: list[str], formulation: Formulation, literals: TranslationLiterals,
                  use_sentence_space: bool = True) -> str | None:
    """The options block (one " A. text" line per choice; the answer space goes before the letter for MCF and
    before the text for Hybrid, so the scored continuation is tokenised as it appears), None for CF."""
    if isinstance(formulation, CFFormulation):
        return None
    prefixes = get_prefix(formulation.choice_prefix, literals)
    space = literals.sentence_space if use_sentence_space else literals.word_space
    stop, gap = literals.full_stop, literals.sentence_space
    if isinstance(formulation, MCFFormulation):
        return "\n".join(f"{space}{prefixes[i]}{stop}{gap}{c}" for i, c in enumerate(choices))
    return "\n".join(f"{gap}{prefixes[i]}{stop}{space}{c}" for i, c in enumerate(choices))


def build_answers(answers: list[str], formulation: Formulation, literals: TranslationLiterals,
                  use_sentence_space: bool = True) -> list[str]:
    """The scored continuations: the prefixes for MCF, the answer texts otherwise, each after the answer space."""
    if isinstance(formulation, MCFFormulation):
        answers = get_prefix(formulation.choice_prefix, literals)[: len(answers)]
    space = literals.sentence_space if use_sentence_space else literals.word_space
    return [f"{space}{a}" for a in answers]


def capitalize(word: str) -> str:
    return word[:1].upper() + word[1:]


def decapitalize(word: str) -> str:
    return word[:1].lower() + word[1:]


_END_PUNCT = {"?": "question_mark", ".": "full_stop", ",": "comma", ":": "colon"}


def fix_ending_punct(text: str, literals: TranslationLiterals) -> str:
    """Right-stripped, with a final ? . , : written the language's way (Chinese "？")."""
    text = text.rstrip()
    if text and text[-1] in _END_PUNCT:
        text = text[:-1] + getattr(literals, _END_PUNCT[text[-1]])
    return text


def punctuation_ends_sentence(text: str, literals: TranslationLiterals) -> bool:
    return text.rstrip().endswith((literals.question_mark, literals.full_stop, literals.exclamation_mark,
                                   literals.colon, literals.semicolon))


def fix_capitalization(prefix: str, text: str, literals: TranslationLiterals) -> str:
    """Capitalised after nothing, a newline or a sentence end; lower-case first letter otherwise."""
    if not prefix or prefix.endswith("\n") or punctuation_ends_sentence(prefix, literals):
        return capitalize(text)
    return decapitalize(text)


# Sentence punctuation (several scripts) stripped from the end of COPA premises and NLI sentences.
PUNCT = ".?!,;:\"'。？！．、，；：।॥؟۔።"


def create_adapter_from_dict(adapter: Mapping[str, Any] | Callable[[dict], Any]) -> Callable[[dict], Any]:
    """A function as it is; a dict {input key: row column} as the function picking those columns."""
    if not isinstance(adapter, Mapping):
        return adapter
    columns = dict(adapter)
    return lambda line: {key: line[column] for key, column in columns.items()}


def _unsupported(*parts) -> UnsupportedPrompt | None:
    return next((p for p in parts if isinstance(p, UnsupportedPrompt)), None)


# ---------------------------------------------------------------- templates


def get_mcq_prompt_function(language: Language, adapter, formulation: Formulation = MCFFormulation()):
    """Multiple choice. Adapter keys: question, choices, gold_idx, optional context and instruction.

    Query: "{instruction}\\n{Context}\\n{Question word}: {Question}\\n{options}\\n{Answer word}:" (lines left out
    when empty; options only for MCF / Hybrid). Question, context and answers are capitalised with their final
    punctuation in the language's form. PMI's unconditioned query is "{Answer word}:"."""
    literals = _literals("multiple choice", language, ("question_word", "answer"), adapter)
    if isinstance(literals, UnsupportedPrompt):
        return literals
    adapter_fn = create_adapter_from_dict(adapter)

    def mcq_prompt(line: dict, task_name: str | None = None):
        data = adapter_fn(line)
        if data is None:
            return None
        instruction = data.get("instruction") or ""
        context = data.get("context")
        answers = [capitalize(fix_ending_punct(str(a), literals)) for a in data["choices"]]
        options = build_choices(answers, formulation, literals)
        answer_word = capitalize(literals.answer)
        query = (f"{instruction}\n" if instruction else "") + (
            f"{capitalize(fix_ending_punct(context, literals))}\n" if context else "")
        query += (f"{capitalize(literals.question_word)}{literals.colon}{literals.sentence_space}"
                  f"{capitalize(fix_ending_punct(data['question'], literals))}\n")
        query += (f"{options}\n" if options else "") + f"{answer_word}{literals.colon}"
        return Doc(task_name=task_name, query=query, choices=build_answers(answers, formulation, literals),
                   gold_index=as_list(data["gold_idx"]), instruction=data.get("instruction"),
                   unconditioned_query=f"{answer_word}{literals.colon}")

    return mcq_prompt


def get_qa_prompt_function(language: Language, adapter):
    """Extractive / open QA as a cloze multiple choice: every distinct reference answer (first-seen order) is a
    gold choice. Adapter keys: question, choices (the references), optional context and instruction."""
    if getattr(adapter, "unsupported_reason", None):
        return UnsupportedPrompt(adapter.unsupported_reason)
    adapter_fn = create_adapter_from_dict(adapter)

    def as_mcq(line: dict):
        data = adapter_fn(line)
        if data is None:
            return None
        references = list(dict.fromkeys(data["choices"]))
        return {**data, "choices": references, "gold_idx": list(range(len(references)))}

    return get_mcq_prompt_function(language, as_mcq, CFFormulation())


def get_continuation_prompt_function(language: Language, adapter, formulation: Formulation = MCFFormulation(),
                                     fix_formatting: bool = True):
    """Sentence completion. Adapter keys: context, continuations, gold_idx, optional instruction.

    CF: the query is "{instruction}\\n{Context}" and each continuation (capitalised after a sentence end, else
    lower-case first letter) is a choice after a space. MCF / Hybrid: "{Context}\\n{options}\\n{Answer word}:"."""
    literals = _literals("continuation", language, () if isinstance(formulation, CFFormulation) else ("answer",), adapter)
    if isinstance(literals, UnsupportedPrompt):
        return literals
    adapter_fn = create_adapter_from_dict(adapter)

    def continuation_prompt(line: dict, task_name: str | None = None):
        data = adapter_fn(line)
        if data is None:
            return None
        instruction = f"{data['instruction']}\n" if data.get("instruction") else ""
        context = capitalize(fix_ending_punct(data["context"], literals)) if fix_formatting else data["context"]
        continuations = [fix_capitalization(context, fix_ending_punct(c, literals), literals) if fix_formatting else c
                         for c in data["continuations"]]
        gold = as_list(data["gold_idx"])
        if isinstance(formulation, CFFormulation):
            answers = build_answers(continuations, formulation, literals,
                                    punctuation_ends_sentence(context, literals))
            return Doc(task_name=task_name, query=f"{instruction}{context}", choices=answers, gold_index=gold,
                       instruction=instruction, unconditioned_query="")
        options = build_choices(continuations, formulation, literals)
        answer_word = capitalize(literals.answer)
        query = f"{instruction}{context}\n" + (f"{options}\n" if options else "") + f"{answer_word}{literals.colon}"
        return Doc(task_name=task_name, query=query, choices=build_answers(continuations, formulation, literals),
                   gold_index=gold, instruction=instruction, unconditioned_query=f"{answer_word}{literals.colon}")

    return continuation_prompt


def hellaswag_preprocess(text: str, wikihow_artifacts: list[str] = (" [title]",), truncate_dots: bool = False,
                         strip_text: bool = False, dot_replacement: str = ". ") -> str:
    """WikiHow markers replaced by `dot_replacement`, other [bracketed] markers dropped, double spaces single."""
    for artifact in wikihow_artifacts:
        text = text.replace(artifact, dot_replacement)
    text = re.sub(r"\[.*?\]", "", text).replace("  ", " ")
    return text.strip() if strip_text else text


def get_hellaswag_prompt_function(language: Language, adapter, formulation: Formulation = MCFFormulation(),
                                  wikihow_artifacts: list[str] = (" [title]",)):
    """HellaSwag: "{Activity label}:\\n{ctx_a} {ctx_b}" completed by the cleaned endings (a continuation prompt).
    Adapter keys: ctx_a, continuations, gold_idx, optional ctx_b, activity_label, instruction. A row with an empty
    ending is skipped (None)."""
    literals = _literals("hellaswag", language, () if isinstance(formulation, CFFormulation) else ("answer",), adapter)
    inner = get_continuation_prompt_function(language, {"context": "context", "continuations": "continuations",
                                                        "gold_idx": "gold_idx", "instruction": "instruction"},
                                             formulation)
    unsupported = _unsupported(literals, inner)
    if unsupported:
        return unsupported
    adapter_fn = create_adapter_from_dict(adapter)

    def clean(text: str) -> str:
        if not text:
            return ""
        text = hellaswag_preprocess(text, wikihow_artifacts, truncate_dots=True, strip_text=True)
        return capitalize(fix_ending_punct(text, literals))

    def hellaswag_prompt(line: dict, task_name: str | None = None):
        data = adapter_fn(line)
        if data is None:
            return None
        label = data.get("activity_label") or ""
        ctx_a, ctx_b = clean(data["ctx_a"]), clean(data.get("ctx_b") or "")
        if ctx_b:
            space = literals.sentence_space if punctuation_ends_sentence(ctx_a, literals) else literals.word_space
            ctx_a = f"{ctx_a.rstrip()}{space}{fix_capitalization(ctx_a, ctx_b, literals)}"
        endings = [hellaswag_preprocess(e, wikihow_artifacts, truncate_dots=True, strip_text=True,
                                        dot_replacement=f"{literals.full_stop}{literals.sentence_space}")
                   for e in data["continuations"]]
        if any(not e.strip() for e in endings):
            return None
        context = (f"{capitalize(label)}:\n" if label else "") + ctx_a
        return inner({"instruction": data.get("instruction", ""), "context": context, "continuations": endings,
                      "gold_idx": data["gold_idx"]}, task_name)

    return hellaswag_prompt


def get_boolq_prompt_function(language: Language, adapter, formulation: Formulation = MCFFormulation()):
    """Yes/no questions as multiple choice between the language's "yes" and "no". Adapter keys: question, answer
    (bool), optional context and instruction."""
    literals = _literals("boolq", language, ("question_word", "answer", "yes", "no"), adapter)
    mcq = get_mcq_prompt_function(language, lambda row: row, formulation)
    unsupported = _unsupported(literals, mcq)
    if unsupported:
        return unsupported
    adapter_fn = create_adapter_from_dict(adapter)

    def boolq_prompt(line: dict, task_name: str | None = None):
        data = adapter_fn(line)
        if data is None:
            return None
        return mcq({"instruction": data.get("instruction", ""), "question": data["question"],
                    "context": data.get("context", ""), "choices": [literals.yes, literals.no],
                    "gold_idx": 0 if data["answer"] else 1}, task_name)

    return boolq_prompt


def get_copa_prompt_function(language: Language, adapter, formulation: Formulation = MCFFormulation()):
    """COPA: "{Premise without final punctuation} {because|therefore}" completed by the alternatives. Adapter keys:
    cause_effect ("cause" or "effect"), context, continuations, gold_idx, optional instruction."""
    literals = _literals("copa", language, ("cause_word", "effect_word"), adapter)
    inner = get_continuation_prompt_function(language, {"context": "context", "continuations": "continuations",
                                                        "gold_idx": "gold_idx", "instruction": "instruction"},
                                             formulation)
    unsupported = _unsupported(literals, inner)
    if unsupported:
        return unsupported
    adapter_fn = create_adapter_from_dict(adapter)

    def copa_prompt(line: dict, task_name: str | None = None):
        data = adapter_fn(line)
        if data is None:
            return None
        link = literals.cause_word if data["cause_effect"] == "cause" else literals.effect_word
        context = f"{capitalize(data['context'].rstrip(PUNCT))}{literals.word_space}{link}"
        return inner({"instruction": data.get("instruction", ""), "context": context,
                      "continuations": data["continuations"], "gold_idx": data["gold_idx"]}, task_name)

    return copa_prompt


def get_nli_prompt_function(language: Language, adapter, relations: list[str],
                            formulation: Formulation = MCFFormulation()):
    """Natural language inference over `relations` (entailment / neutral / contradiction, in label order).
    Adapter keys: premise, hypothesis, gold_idx, optional instruction.

    CF: "{Premise}{space}{right}?" completed by " {Yes|Also|No}, {hypothesis}". MCF / Hybrid: a multiple-choice
    question with the premise as context, the hypothesis as question (Hybrid: followed by "True, False or
    Neither?") and the labels true / neither / false."""
    cloze = isinstance(formulation, CFFormulation)
    needs = ("confirmation_word", "yes", "no", "also") if cloze else ("true", "false", "neither", "or_word")
    literals = _literals("nli", language, needs, adapter)
    if isinstance(literals, UnsupportedPrompt):
        return literals
    adapter_fn = create_adapter_from_dict(adapter)
    words = ({"entailment": literals.yes, "contradiction": literals.no, "neutral": literals.also} if cloze else
             {"entailment": literals.true, "contradiction": literals.false, "neutral": literals.neither})
    labels = [capitalize(words[r]) for r in relations]

    if cloze:
        def nli_cloze(line: dict, task_name: str | None = None):
            data = adapter_fn(line)
            if data is None:
                return None
            premise = capitalize(data["premise"].rstrip(PUNCT))
            hypothesis = decapitalize(data["hypothesis"].rstrip(PUNCT))
            ask = f"{literals.confirmation_word}{literals.question_mark}"
            return Doc(task_name=task_name, query=f"{data.get('instruction', '')}{premise}{literals.word_space}{ask}",
                       choices=[f"{literals.sentence_space}{label}{literals.comma}{literals.word_space}{hypothesis}"
                                for label in labels],
                       gold_index=data["gold_idx"], unconditioned_query=ask)

        return nli_cloze

    mcq = get_mcq_prompt_function(language, lambda row: row,
                                  CFFormulation() if isinstance(formulation, HybridFormulation) else formulation)
    if isinstance(mcq, UnsupportedPrompt):
        return mcq

    def nli_mcq(line: dict, task_name: str | None = None):
        data = adapter_fn(line)
        if data is None:
            return None
        hypothesis = data["hypothesis"]
        if isinstance(formulation, HybridFormulation):
            shown = list(labels)
            if "neutral" in relations:  # the neutral label is offered last
                shown.append(shown.pop(relations.index("neutral")))
            listed = f"{literals.comma}{literals.word_space}".join(shown[:-1])
            hypothesis = (f"{hypothesis.rstrip(PUNCT)}{literals.sentence_space}{listed}{literals.word_space}"
                          f"{literals.or_word}{literals.word_space}{shown[-1]}{literals.question_mark}")
        return mcq({"instruction": data.get("instruction", ""), "gold_idx": data["gold_idx"], "choices": labels,
                    "context": fix_ending_punct(capitalize(data["premise"]), literals), "question": hypothesis},
                   task_name)

    return nli_mcq


# ISO 639-1 codes of the languages that have one: translation prompts label texts with the shortest tag ("EN", as
# BCP 47 writes it); a language without one keeps its three letters ("ACE").
ISO_639_1 = dict(pair.split(":") for pair in (
    "afr:af aka:ak sqi:sq amh:am ara:ar hye:hy asm:as aze:az bam:bm bak:ba eus:eu bel:be ben:bn bos:bs bre:br bul:bg "
    "mya:my cat:ca nya:ny zho:zh hrv:hr ces:cs dan:da nld:nl eng:en epo:eo est:et ewe:ee fao:fo fij:fj fin:fi fra:fr "
    "glg:gl lug:lg kat:ka deu:de ell:el grn:gn guj:gu hat:ht hau:ha heb:he hin:hi hun:hu isl:is ibo:ig ind:id gle:ga "
    "ita:it jpn:ja jav:jv kan:kn kaz:kk khm:km kin:rw kir:ky kor:ko kur:ku lao:lo lat:la lav:lv lin:ln lit:lt ltz:lb "
    "mkd:mk mlg:mg msa:ms mal:ml mlt:mt mri:mi mar:mr mon:mn nep:ne nor:no nob:nb nno:nn oci:oc ori:or orm:om pus:ps "
    "fas:fa pol:pl por:pt pan:pa que:qu ron:ro rus:ru san:sa gla:gd srp:sr sna:sn snd:sd sin:si slk:sk slv:sl som:so "
    "sot:st spa:es sun:su swa:sw swe:sv tgl:tl tgk:tg tam:ta tat:tt tel:te tha:th bod:bo tir:ti tsn:tn tur:tr tuk:tk "
    "twi:tw ukr:uk urd:ur uig:ug uzb:uz vie:vi cym:cy wol:wo xho:xh yid:yi yor:yo zul:zu").split())


def language_label(language: Language) -> str:
    """"EN" for English, "ACE" for Acehnese: the language's shortest code, upper case."""
    code = language.value.split("_")[0]
    return ISO_639_1.get(code, code).upper()


def get_translation_prompt_function(source_language: Language, target_language: Language, adapter,
                                    formulation: Formulation = MCFFormulation()):
    """Translation as continuation: "{SRC}: {Source text} {TGT}:" completed by the target text(s) (each capitalised,
    its final punctuation the target language's). Adapter keys: source_text, target_text (one or several), optional
    gold_idx (default: every target) and instruction. Only punctuation is taken from the languages' literals (the
    defaults for a language nano_eval has no words for)."""
    if getattr(adapter, "unsupported_reason", None):
        return UnsupportedPrompt(adapter.unsupported_reason)
    inner = get_continuation_prompt_function(Language.ENGLISH, {"context": "context", "continuations": "continuations",
                                                                "gold_idx": "gold_idx", "instruction": "instruction"},
                                             formulation, fix_formatting=False)
    source = TRANSLATION_LITERALS.get(source_language) or TranslationLiterals(source_language)
    target = TRANSLATION_LITERALS.get(target_language) or TranslationLiterals(target_language)
    labels = language_label(source_language), language_label(target_language)
    adapter_fn = create_adapter_from_dict(adapter)

    def translation_prompt(line: dict, task_name: str | None = None):
        data = adapter_fn(line)
        if data is None:
            return None
        text = capitalize(fix_ending_punct(data["source_text"], source))
        targets = [capitalize(fix_ending_punct(t, target)) for t in as_list(data["target_text"])]
        return inner({"instruction": data.get("instruction", ""), "context": f"{labels[0]}: {text} {labels[1]}:",
                      "continuations": targets, "gold_idx": data.get("gold_idx", list(range(len(targets))))},
                     task_name)

    return translation_prompt


__all__ = [
    "CFFormulation", "Formulation", "HybridFormulation", "LITERAL_LANGUAGES", "MCFFormulation", "TRANSLATION_LITERALS",
    "TranslationLiterals", "UnsupportedPrompt", "build_answers", "build_choices", "capitalize",
    "create_adapter_from_dict", "decapitalize", "fix_capitalization", "fix_ending_punct", "get_boolq_prompt_function",
    "get_continuation_prompt_function", "get_copa_prompt_function", "get_hellaswag_prompt_function",
    "get_mcq_prompt_function", "get_nli_prompt_function", "get_prefix", "get_qa_prompt_function",
    "get_translation_prompt_function", "hellaswag_preprocess", "language_label", "punctuation_ends_sentence",
]
