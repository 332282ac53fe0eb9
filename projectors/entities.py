"""Deterministic entity extraction: no network, no model, the same names on every replay.

Four extractors run over the text; their matches are returned in first-seen order,
normalised (casefolded, whitespace collapsed) and without duplicates:

1. dates: ``2023-05-07``, ``May 7, 2023``, ``7th of May 2023`` (all ``2023-05-07``),
   ``May 2023`` (``2023-05``), ``May 7`` (``may 7``);
2. quoted titles: ``"..."``, ``'...'``, ``“...”``, ``‘...’`` (1 to 120 characters);
3. amounts: currency (``$20``, ``€5.50``, ``$3k``), percentages (``10%``, ``10 percent``
   -> ``10%``) and numbers with a unit (``5 km``, ``5km``, ``3 weeks`` -> ``5 km``,
   ``3 weeks``);
4. capitalised phrases: runs of capitalised words (``Caroline``, ``New York``,
   ``Bank of America``), where a sentence-initial common word (``Yesterday``, ``The``,
   ``Thanks``...) and the pronoun ``I`` never start or join a run, titles (``Dr.``,
   ``Mrs``) are dropped and a possessive ``'s`` is stripped.

See ``docs/ENTITIES.md`` for what this does not catch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

_MONTH_NAMES = (
    ("january", "jan"),
    ("february", "feb"),
    ("march", "mar"),
    ("april", "apr"),
    ("may",),
    ("june", "jun"),
    ("july", "jul"),
    ("august", "aug"),
    ("september", "sept", "sep"),
    ("october", "oct"),
    ("november", "nov"),
    ("december", "dec"),
)
MONTHS: dict[str, int] = {
    name: number for number, names in enumerate(_MONTH_NAMES, 1) for name in names
}
_MONTH = r"(?P<month>" + "|".join(sorted(MONTHS, key=len, reverse=True)) + r")\.?"
_ORD = r"(?:st|nd|rd|th)?"

_ISO_DATE = re.compile(r"\b(?P<year>\d{4})-(?P<mon>\d{2})-(?P<day>\d{2})\b")
_MONTH_DAY = re.compile(
    rf"\b{_MONTH}\s+(?P<day>\d{{1,2}}){_ORD}(?:,?\s+(?P<year>\d{{4}}))?\b", re.IGNORECASE
)
_DAY_MONTH = re.compile(
    rf"\b(?P<day>\d{{1,2}}){_ORD}\s+(?:of\s+)?{_MONTH}(?:,?\s+(?P<year>\d{{4}}))?\b",
    re.IGNORECASE,
)
_MONTH_YEAR = re.compile(rf"\b{_MONTH}\s+(?P<year>\d{{4}})\b", re.IGNORECASE)

_QUOTED = re.compile(
    r"\"(?P<a>[^\"\n]{1,120})\""
    r"|“(?P<b>[^”\n]{1,120})”"
    r"|‘(?P<c>[^’\n]{1,120})’"
    r"|(?<![\w'])'(?P<d>[^'\n]{1,120})'(?!\w)"
)

_CURRENCY = re.compile(
    r"(?P<sym>[$€£¥])\s?(?P<num>\d[\d,]*(?:\.\d+)?)"
    r"(?:\s?(?P<mult>k|m|bn|thousand|million|billion)\b)?",
    re.IGNORECASE,
)
_PERCENT = re.compile(r"\b(?P<num>\d+(?:\.\d+)?)\s?(?:%|percent\b|per cent\b)", re.IGNORECASE)
_UNITS = (
    "seconds|second|secs|sec|minutes|minute|mins|min|hours|hour|hrs|hr|days|day|weeks|week|"
    "months|month|years|year|yrs|decades|decade|"
    "kilometres|kilometers|kilometre|kilometer|km|metres|meters|metre|meter|m|miles|mile|mi|"
    "feet|foot|ft|inches|inch|cm|mm|"
    "kilograms|kilogram|kg|grams|gram|g|pounds|pound|lbs|lb|ounces|ounce|oz|"
    "litres|liters|litre|liter|l|ml|gallons|gallon|"
    "degrees|degree|°c|°f|mph|kph|km/h|"
    "dollars|dollar|euros|euro|usd|eur|gbp|bucks|cents|"
    "times|pages|page|books|kids|children|people|steps|reps|sets|calories|kcal"
)
_NUMBER_UNIT = re.compile(
    rf"\b(?P<num>\d+(?:[.,]\d+)?)\s?-?\s?(?P<unit>{_UNITS})(?![\w/])", re.IGNORECASE
)

_WORD = re.compile(r"[^\W\d_](?:[\w'’\-]*\w)?")
_LOWER_WORDS = re.compile(r"(?:[\W\d_]*[a-z](?:[\w'’\-]*\w)?)*")
"""A run of what ``_WORD`` finds when each word starts with ``a``-``z``, and what lies
between them: ``[\\W\\d_]`` is every character that cannot start a word."""
_SENTENCE_BREAK = re.compile(r"[.!?:;\n\"“”()\[\]]")
_CONNECTORS = frozenset({"of", "de", "da", "del", "der", "di", "du", "la", "le", "van", "von"})
_TITLES = frozenset({"mr", "mrs", "ms", "mx", "dr", "prof", "sir", "madam", "miss"})
_PRONOUN_I = frozenset({"i", "i'm", "i've", "i'd", "i'll", "i’m", "i’ve", "i’d", "i’ll"})
_MAX_PHRASE_WORDS = 6

_COMMON_WORDS_TEXT = """
a an the this that these those there here it its it's i'm i've i'd i'll you you're you've
you'll you'd we we're we've we'll we'd they they're they've they'll he he's she she's him
her his hers my mine your yours our ours their theirs me us them one some any all each every
both either neither no not none nothing something anything everything someone anyone
everyone nobody somebody anybody everybody and or but nor so yet for because since though
although if unless while whereas as at by from in into of off on onto out over to up with
without about above after against along among around before behind below beside between
beyond during except inside like near through throughout toward towards under until upon
within what what's when where where's who who's whom whose why how how's which is are was
were be been being am do does did done have has had having can could would should will shall
may might must let let's lets yes yeah yep no nope ok okay oh ah aw wow hey hi hello bye
goodbye thanks thank please sorry sure well great cool nice awesome amazing good fine right
true wait congrats congratulations haha lol hmm um uh also just actually really maybe
perhaps definitely absolutely anyway anyways besides however still sometimes usually often
always never ever already again even only then now today tonight tomorrow yesterday recently
lately finally first firstly second secondly last next once soon later earlier meanwhile
otherwise instead indeed plus overall honestly basically probably hopefully luckily
unfortunately speaking talking remember keep make made get got go went going see saw look
looking take took try tried tell told think thought know knew hope wish glad happy love
loved like liked need needed want wanted feel felt guess bet imagine check find found give
gave put call called ask asked say said use used buy bought read
"""
COMMON_WORDS: frozenset[str] = frozenset(_COMMON_WORDS_TEXT.split())
"""Words that never start an entity when they open a sentence."""


def normalise_entity(name: str) -> str:
    """The canonical form of an entity name: casefolded, whitespace collapsed."""
    return " ".join(name.casefold().split())


def extract_entities(text: str) -> list[str]:
    """Normalised entity names of ``text``, unique, in first-seen order."""
    return _extract(text, fast=True)


def _extract(text: str, *, fast: bool) -> list[str]:
    """``extract_entities``; ``fast=False`` skips the shortcuts (tests compare the two)."""
    found: list[tuple[int, str]] = []
    taken: list[tuple[int, int]] = []
    for start, end, name in _structured_matches(text, fast=fast):
        if any(start < t_end and t_start < end for t_start, t_end in taken):
            continue
        taken.append((start, end))
        found.append((start, name))
    found.extend(_capitalised_phrases(text, taken, fast=fast))
    found.sort(key=lambda item: item[0])
    seen: set[str] = set()
    names: list[str] = []
    for _, name in found:
        normal = normalise_entity(name)
        if normal and normal not in seen:
            seen.add(normal)
            names.append(normal)
    return names


def _lowered(pattern: re.Pattern[str]) -> re.Pattern[str]:
    """``pattern`` without IGNORECASE, for ASCII text already lower-cased: on ASCII text
    the two match the same spans (the extra non-ASCII case folds, such as ``ſ`` for ``s``,
    cannot occur), and every name taken from a match is casefolded afterwards anyway."""
    return re.compile(pattern.pattern)


_ISO_DATE_L, _MONTH_DAY_L, _DAY_MONTH_L, _MONTH_YEAR_L = (
    _lowered(p) for p in (_ISO_DATE, _MONTH_DAY, _DAY_MONTH, _MONTH_YEAR)
)
_CURRENCY_L, _PERCENT_L, _NUMBER_UNIT_L = (_lowered(p) for p in (_CURRENCY, _PERCENT, _NUMBER_UNIT))
_DIGIT = re.compile(r"\d")
_MONTH_STEMS = tuple(sorted({name[:3] for name in MONTHS}))
_QUOTE_MARKS = ('"', "'", "“", "‘")


def _structured_matches(text: str, *, fast: bool = True) -> Iterator[tuple[int, int, str]]:
    """Dates first, then quotes, then amounts: an earlier extractor owns its span.

    With ``fast``, extractors that cannot match are skipped (every date and amount needs
    a digit, a month name starts with one of ``_MONTH_STEMS``, a title needs a quote
    mark; in ASCII text an ISO date needs a ``-``, a currency amount a ``$`` and a
    percentage ``%`` or ``per``), and ASCII text is matched lower-cased without
    IGNORECASE (about twice as fast); the matches are the same."""
    digits = not fast or _DIGIT.search(text) is not None
    ascii_lower = text.lower() if fast and text.isascii() else None
    subject = text if ascii_lower is None else ascii_lower
    months = digits and (ascii_lower is None or any(stem in ascii_lower for stem in _MONTH_STEMS))
    lower = ascii_lower is not None
    iso_dates = currencies = percentages = digits
    if lower and digits:
        iso_dates, currencies = "-" in subject, "$" in subject
        percentages = "%" in subject or "per" in subject
    if iso_dates:
        for match in (_ISO_DATE_L if lower else _ISO_DATE).finditer(subject):
            if _valid_date(int(match["mon"]), int(match["day"])):
                yield match.start(), match.end(), match.group(0)
    if months:
        for pattern in (_MONTH_DAY_L, _DAY_MONTH_L) if lower else (_MONTH_DAY, _DAY_MONTH):
            for match in pattern.finditer(subject):
                month = MONTHS[match["month"].casefold()]
                day = int(match["day"])
                if not _valid_date(month, day):
                    continue
                if match["year"]:
                    name = f"{match['year']}-{month:02d}-{day:02d}"
                else:
                    name = f"{match['month'].rstrip('.')} {day}"
                yield match.start(), match.end(), name
        for match in (_MONTH_YEAR_L if lower else _MONTH_YEAR).finditer(subject):
            month = MONTHS[match["month"].casefold()]
            yield match.start(), match.end(), f"{match['year']}-{month:02d}"
    if not fast or any(mark in text for mark in _QUOTE_MARKS):
        for match in _QUOTED.finditer(subject):
            title = next(group for group in match.groups() if group is not None).strip()
            if title and any(ch.isalnum() for ch in title):
                yield match.start(), match.end(), title
    if currencies:
        for match in (_CURRENCY_L if lower else _CURRENCY).finditer(subject):
            multiplier = (match["mult"] or "").casefold()
            yield match.start(), match.end(), f"{match['sym']}{match['num']}{multiplier}"
    if percentages:
        for match in (_PERCENT_L if lower else _PERCENT).finditer(subject):
            yield match.start(), match.end(), f"{match['num']}%"
    if digits:
        for match in (_NUMBER_UNIT_L if lower else _NUMBER_UNIT).finditer(subject):
            yield match.start(), match.end(), f"{match['num']} {match['unit']}"


def _valid_date(month: int, day: int) -> bool:
    return 1 <= month <= 12 and 1 <= day <= 31


def _capitalised_phrases(
    text: str, taken: list[tuple[int, int]], *, fast: bool = True
) -> Iterator[tuple[int, str]]:
    phrase: list[str] = []
    pending: list[str] = []
    phrase_start = 0
    previous_end = 0
    first = True
    while True:
        if fast and not phrase:
            # Words that start with an ASCII lower-case letter, skipped in one C scan.
            skipped = _LOWER_WORDS.match(text, previous_end)
            if skipped is not None and skipped.end() > previous_end:
                previous_end = skipped.end()
                first = False
        match = _WORD.search(text, previous_end)
        if match is None:
            break
        word = match.group(0)
        if fast and not phrase and not word[0].isupper():
            # Nothing to end and nothing to start (stripping a possessive keeps the first
            # letter): the common case, and only the position and ``first`` move on.
            previous_end = match.end()
            first = False
            continue
        gap = text[previous_end : match.start()]
        previous_end = match.end()
        inside_taken = bool(taken) and any(
            start < match.end() and match.start() < end for start, end in taken
        )
        sentence_start = first or _SENTENCE_BREAK.search(gap) is not None
        first = False
        plain = _strip_possessive(word)
        lowered = plain.casefold()
        if phrase and not sentence_start and gap.strip() == "" and not inside_taken:
            if lowered in _CONNECTORS and word.islower():
                pending.append(word)
                continue
            if _capitalised(plain) and lowered not in _PRONOUN_I:
                phrase.extend(pending)
                pending = []
                phrase.append(plain)
                if plain != word or len(phrase) >= _MAX_PHRASE_WORDS:
                    yield phrase_start, " ".join(phrase)
                    phrase = []
                continue
        if phrase:
            yield phrase_start, " ".join(phrase)
        phrase, pending = [], []
        if inside_taken or not _capitalised(plain) or lowered in _PRONOUN_I:
            continue
        if lowered in _TITLES or (sentence_start and lowered in COMMON_WORDS):
            continue
        phrase = [plain]
        phrase_start = match.start()
        if plain != word:
            yield phrase_start, plain
            phrase = []
    if phrase:
        yield phrase_start, " ".join(phrase)


def _capitalised(word: str) -> bool:
    return word[0].isupper()


def _strip_possessive(word: str) -> str:
    for suffix in ("'s", "’s", "'", "’"):
        if word.endswith(suffix) and len(word) > len(suffix):
            return word[: -len(suffix)]
    return word
