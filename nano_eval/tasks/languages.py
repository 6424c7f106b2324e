"""Languages by English name, valued by ISO 639-3 code: lighteval's `Language` for its multilingual task files.

`Language.FRENCH.value == "fra"`. Macrolanguages use the macro code (`ARABIC = "ara"`, `CHINESE = "zho"`,
`MALAY = "msa"`); a few individual varieties that lighteval's task files name have their own member. Members are
written for nano_eval from the ISO 639-3 code tables; lighteval names a few members outside ISO's names (`TWI`,
`CHINESE_TRADITIONAL`): those exist here too, so its files import.
"""

from __future__ import annotations

import enum


class Language(enum.Enum):
    """`Language("xyz")` for a code without a member (lighteval lists some 200) gives a member named "XYZ", so files
    that build languages from codes load; templates have no words for it (their tasks refuse to run)."""

    @classmethod
    def _missing_(cls, value):
        if isinstance(value, str) and value.isascii() and value.isalpha() and len(value) == 3 and value.islower():
            member = object.__new__(cls)
            member._name_, member._value_ = value.upper(), value
            return cls._value2member_map_.setdefault(value, member)
        return None

    AFRIKAANS = "afr"
    AKAN = "aka"
    ALBANIAN = "sqi"
    AMHARIC = "amh"
    ARABIC = "ara"
    ARMENIAN = "hye"
    ASSAMESE = "asm"
    ASTURIAN = "ast"
    AZERBAIJANI = "aze"
    BAMBARA = "bam"
    BASHKIR = "bak"
    BASQUE = "eus"
    BELARUSIAN = "bel"
    BEMBA = "bem"
    BENGALI = "ben"
    BHOJPURI = "bho"
    BOSNIAN = "bos"
    BRETON = "bre"
    BULGARIAN = "bul"
    BURMESE = "mya"
    CATALAN = "cat"
    CEBUANO = "ceb"
    CHICHEWA = "nya"
    CHINESE = "zho"
    CHINESE_TRADITIONAL = "zho_Hant"
    CHINESE_HONG_KONG = "zho_HK"
    CROATIAN = "hrv"
    CZECH = "ces"
    DANISH = "dan"
    DUTCH = "nld"
    EGYPTIAN_ARABIC = "arz"
    ENGLISH = "eng"
    ESPERANTO = "epo"
    ESTONIAN = "est"
    EWE = "ewe"
    FAROESE = "fao"
    FIJIAN = "fij"
    FILIPINO = "fil"
    FINNISH = "fin"
    FON = "fon"
    FRENCH = "fra"
    GALICIAN = "glg"
    GANDA = "lug"
    GEORGIAN = "kat"
    GERMAN = "deu"
    GREEK = "ell"
    GUARANI = "grn"
    GUJARATI = "guj"
    HAITIAN = "hat"
    HAITIAN_CREOLE = "hat_HT"
    HAUSA = "hau"
    HEBREW = "heb"
    HINDI = "hin"
    HUNGARIAN = "hun"
    ICELANDIC = "isl"
    IGBO = "ibo"
    ILOCANO = "ilo"
    INDONESIAN = "ind"
    IRISH = "gle"
    ITALIAN = "ita"
    JAPANESE = "jpn"
    JAVANESE = "jav"
    KANNADA = "kan"
    KAZAKH = "kaz"
    KHMER = "khm"
    KINYARWANDA = "kin"
    KIRGHIZ = "kir"
    KOREAN = "kor"
    KURDISH = "kur"
    LAO = "lao"
    LATIN = "lat"
    LATVIAN = "lav"
    LINGALA = "lin"
    LITHUANIAN = "lit"
    LUGANDA = "lug_UG"
    LUXEMBOURGISH = "ltz"
    MACEDONIAN = "mkd"
    MALAGASY = "mlg"
    MALAY = "msa"
    MALAYALAM = "mal"
    MALTESE = "mlt"
    MAORI = "mri"
    MARATHI = "mar"
    MODERN_STANDARD_ARABIC = "arb"
    MONGOLIAN = "mon"
    MOROCCAN_ARABIC = "ary"
    NEPALI = "nep"
    NORTHERN_SOTHO = "nso"
    NORWEGIAN = "nor"
    NORWEGIAN_BOKMAL = "nob"
    NORWEGIAN_NYNORSK = "nno"
    OCCITAN = "oci"
    ORIYA = "ori"
    OROMO = "orm"
    PASHTO = "pus"
    PERSIAN = "fas"
    POLISH = "pol"
    PORTUGUESE = "por"
    PUNJABI = "pan"
    QUECHUA = "que"
    ROMANIAN = "ron"
    RUSSIAN = "rus"
    SANSKRIT = "san"
    SCOTTISH_GAELIC = "gla"
    SERBIAN = "srp"
    SHONA = "sna"
    SINDHI = "snd"
    SINHALA = "sin"
    SLOVAK = "slk"
    SLOVENIAN = "slv"
    SOMALI = "som"
    SOTHO = "sot"
    SOUTHERN_SOTHO = "sot_ZA"
    SPANISH = "spa"
    SUNDANESE = "sun"
    SWAHILI = "swa"
    SWEDISH = "swe"
    TAGALOG = "tgl"
    TAJIK = "tgk"
    TAMIL = "tam"
    TATAR = "tat"
    TELUGU = "tel"
    THAI = "tha"
    TIBETAN = "bod"
    TIGRINYA = "tir"
    TSWANA = "tsn"
    TURKISH = "tur"
    TURKMEN = "tuk"
    TWI = "twi"
    UKRAINIAN = "ukr"
    URDU = "urd"
    UYGHUR = "uig"
    UZBEK = "uzb"
    VIETNAMESE = "vie"
    WELSH = "cym"
    WOLOF = "wol"
    XHOSA = "xho"
    YIDDISH = "yid"
    YORUBA = "yor"
    ZULU = "zul"


class _CodeToLanguage(dict):
    """A code not listed maps to `Language(code)` (a member made for it when there is none)."""

    def __missing__(self, code: str) -> Language:
        return Language(code)


# Individual-language codes that data sets use, mapped to the member for their macrolanguage (or the language).
iso_639_3_ind_to_iso_639_3_macro: dict[str, Language] = _CodeToLanguage({
    **{lang.value: lang for lang in Language if len(lang.value) == 3},
    "arb": Language.ARABIC, "arz": Language.ARABIC, "ary": Language.ARABIC, "acm": Language.ARABIC,
    "apc": Language.ARABIC, "ars": Language.ARABIC, "ajp": Language.ARABIC, "aeb": Language.ARABIC,
    "cmn": Language.CHINESE, "yue": Language.CHINESE, "zsm": Language.MALAY, "npi": Language.NEPALI,
    "swh": Language.SWAHILI, "pes": Language.PERSIAN, "prs": Language.PERSIAN, "nob": Language.NORWEGIAN,
    "nno": Language.NORWEGIAN, "ory": Language.ORIYA, "pbt": Language.PASHTO, "uzn": Language.UZBEK,
    "lvs": Language.LATVIAN, "ekk": Language.ESTONIAN, "khk": Language.MONGOLIAN, "plt": Language.MALAGASY,
    "gaz": Language.OROMO, "quy": Language.QUECHUA, "fil": Language.TAGALOG, "tgl": Language.TAGALOG,
})


def manage_duplicate_language_codes(langcode: str) -> str:
    """Two codes data sets use for one language, as lighteval folds them: Nepali `npi` -> `nep`, Swahili `swh` ->
    `swa`; any other code is returned as it is."""
    return {"npi": "nep", "swh": "swa"}.get(langcode, langcode)


__all__ = ["Language", "iso_639_3_ind_to_iso_639_3_macro", "manage_duplicate_language_codes"]
