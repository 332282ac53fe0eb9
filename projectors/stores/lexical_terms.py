"""The form of a text the lexical index searches, and a query's words and phrases in it.

Tantivy's simple tokenizer splits on anything that is not a letter or digit, so a run of
Chinese or Japanese (written without spaces) would be one word. The search form puts a
space around each character of those scripts and of Korean Hangul (whose particles attach
to the word), so each is a word of its own, as Lucene's standard tokenizer makes of Han and
Hiragana, after NFKC normalisation (half-width kana and full-width Latin take their usual
form, decomposed Hangul is composed). ASCII text is its own search form. A query searches
each character and, on ``text``, each pair of neighbours as a phrase, so the characters in
the query's order rank first.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Final

import regex

_UNSPACED: Final = r"[\p{Han}\p{Hiragana}\p{Katakana}\p{Hangul}]"
_UNSPACED_CHAR: Final = regex.compile(_UNSPACED)
_BESIDE_UNSPACED: Final = regex.compile(rf"(?<={_UNSPACED})(?=\w)|(?<=\w)(?={_UNSPACED})")
_UNSPACED_RUN: Final = regex.compile(rf"{_UNSPACED}{{2,}}")
_POINTED: Final = re.compile(r"[\u0370-\u03ff\u1f00-\u1fff\u0401\u0451\u0590-\u06ff\u0750-\u077f]")
"""Greek, ``ё``, Hebrew and Arabic: scripts whose marks a search leaves out."""
_OPTIONAL_MARKS: Final = re.compile(
    r"(?<=[\u0370-\u03ff\u1f00-\u1fff])[\u0300-\u036f]+"  # Greek accents, diaeresis
    r"|(?<=[\u0415\u0435])\u0308"  # ё as е
    r"|[\u0591-\u05bd\u05bf\u05c1\u05c2\u05c4\u05c5\u05c7]"  # Hebrew points, cantillation
    r"|[\u0610-\u061a\u0640\u064b-\u065f\u0670\u06d6-\u06dc\u06df-\u06e4\u06e7\u06e8"
    r"\u06ea-\u06ed]"  # Arabic harakat, Quranic marks, tatweel
)


def search_form(text: str) -> str:
    """``text`` as the index takes it: NFKC; Turkish ``İ`` as ``I`` (lower-cased it would
    be ``i`` and a combining dot, which splits the word), and without a combining dot
    above; Greek final ``ς`` as ``σ``; Greek without accents, ``ё`` as
    ``е``, Hebrew without points and Arabic without harakat or tatweel (Tantivy's ASCII
    folding only folds Latin); and a space between a character of a script written
    without spaces and a letter or digit beside it. Applying it twice changes nothing more."""
    if text.isascii():
        return text
    form = _formed(text)
    for _ in range(_MAX_PASSES):  # a mark reordered next to a Greek letter goes next time
        again = _formed(form)
        if again == form:
            break
        form = again
    return form


_MAX_PASSES: Final = 8
_SAME_LETTERS: Final = str.maketrans({"\u0130": "I", "\u0307": None, "\u03c2": "\u03c3"})
"""Turkish ``İ`` as ``I`` and the combining dot that lower-casing it leaves after ``i``
(either splits the word), and Greek final ``ς`` as ``σ`` (``ΚΑΦΕΣ`` lower-cases to ``σ``)."""


def _formed(text: str) -> str:
    normal = unicodedata.normalize("NFKC", text).translate(_SAME_LETTERS)
    if _POINTED.search(normal):
        bare = _OPTIONAL_MARKS.sub("", unicodedata.normalize("NFD", normal))
        normal = unicodedata.normalize("NFC", bare)
    if _UNSPACED_CHAR.search(normal) is None:
        return normal
    return _BESIDE_UNSPACED.sub(" ", normal)


def unspaced_pairs(query: str, limit: int) -> list[tuple[str, str]]:
    """The neighbouring pairs in the query's runs of unspaced characters, each once, at
    most ``limit``: ``咖啡店`` gives ``(咖, 啡)`` and ``(啡, 店)``."""
    if query.isascii():
        return []
    pairs: dict[tuple[str, str], None] = {}
    for run in _UNSPACED_RUN.findall(unicodedata.normalize("NFKC", query)):
        for pair in zip(run, run[1:], strict=False):
            pairs.setdefault(pair, None)
            if len(pairs) == limit:
                return list(pairs)
    return list(pairs)
