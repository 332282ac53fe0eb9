"""Query analysis: what each channel is asked, as documented, switchable stages.

- ``strip_stopwords``: the lexical channel gets the query without stopwords and question
  words (BM25 gains nothing from "what", "did", "the").
- ``temporal_cues``: a question that asks for a time ("when", "how long", "what year")
  is marked with its cue; retrieval then favours memories whose text states a time.
- ``date_match``: the dates a question names ("in May 2023", "on 8 May 2023") are parsed
  into spans; retrieval then favours memories whose ``occurred_at`` falls in one.
- ``speaker_match``: the owner's speakers the query names ("What did Caroline paint?")
  are found; retrieval then favours memories those speakers said.
- ``strip_speakers``: the vector channel embeds the query without those names: memories
  are embedded as "<speaker>: <text>", so a name in the query pulls every memory of that
  speaker alike; the speaker stage carries it instead.
- entities: the graph channel gets the query's entities (same extractor as the projector).

Each stage is switched by its :class:`QuerySettings` flag and reported in the receipt.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Final

import msgspec
import regex
import tantivy

from prme.projectors.entities import extract_entities
from prme.schemas.config import QuerySettings

from .temporal import DateSpan, date_mentions, time_cue

STOPWORDS = frozenset(
    [
        "a",
        "about",
        "above",
        "after",
        "again",
        "against",
        "all",
        "am",
        "an",
        "and",
        "any",
        "are",
        "aren't",
        "as",
        "at",
        "be",
        "because",
        "been",
        "before",
        "being",
        "below",
        "between",
        "both",
        "but",
        "by",
        "can",
        "can't",
        "cannot",
        "could",
        "couldn't",
        "did",
        "didn't",
        "do",
        "does",
        "doesn't",
        "doing",
        "don't",
        "down",
        "during",
        "each",
        "few",
        "for",
        "from",
        "further",
        "had",
        "hadn't",
        "has",
        "hasn't",
        "have",
        "haven't",
        "having",
        "he",
        "he'd",
        "he'll",
        "he's",
        "her",
        "here",
        "here's",
        "hers",
        "herself",
        "him",
        "himself",
        "his",
        "how",
        "how's",
        "i",
        "i'd",
        "i'll",
        "i'm",
        "i've",
        "if",
        "in",
        "into",
        "is",
        "isn't",
        "it",
        "it's",
        "its",
        "itself",
        "let's",
        "me",
        "more",
        "most",
        "mustn't",
        "my",
        "myself",
        "no",
        "nor",
        "not",
        "of",
        "off",
        "on",
        "once",
        "only",
        "or",
        "other",
        "ought",
        "our",
        "ours",
        "ourselves",
        "out",
        "over",
        "own",
        "same",
        "shan't",
        "she",
        "she'd",
        "she'll",
        "she's",
        "should",
        "shouldn't",
        "so",
        "some",
        "such",
        "than",
        "that",
        "that's",
        "the",
        "their",
        "theirs",
        "them",
        "themselves",
        "then",
        "there",
        "there's",
        "these",
        "they",
        "they'd",
        "they'll",
        "they're",
        "they've",
        "this",
        "those",
        "through",
        "to",
        "too",
        "under",
        "until",
        "up",
        "very",
        "was",
        "wasn't",
        "we",
        "we'd",
        "we'll",
        "we're",
        "we've",
        "were",
        "weren't",
        "what",
        "what's",
        "when",
        "when's",
        "where",
        "where's",
        "which",
        "while",
        "who",
        "who's",
        "whom",
        "why",
        "why's",
        "with",
        "won't",
        "would",
        "wouldn't",
        "you",
        "you'd",
        "you'll",
        "you're",
        "you've",
        "your",
        "yours",
        "yourself",
        "yourselves",
        "kind",
        "sort",
        "ever",
        "also",
        "likely",
        "might",
        "must",
        "shall",
        "will",
        "just",
        "much",
        "many",
        "something",
        "anything",
    ]
)

_TOKEN = regex.compile(r"[\p{L}\p{N}_'’][\w\p{M}'’]*")
"""A word of the query: a letter, digit or apostrophe, then combining marks too, which
Python's ``re`` leaves out of ``\\w`` (it split a Hindi or Thai word at its vowel signs
where the lexical index keeps it whole); a lone mark (an emoji's variation selector) is
no word."""


class QueryAnalysis(msgspec.Struct, frozen=True, kw_only=True):
    query: str
    lexical_query: str
    """What the lexical channel searches."""
    vector_query: str
    """What the vector channel embeds."""
    speakers: list[str] = []
    """The owner's speakers the query names (``speaker_match`` on)."""
    entities: list[str]
    """What the graph channel starts from."""
    time_cue: str | None = None
    """The phrase asking for a time (``temporal_cues`` on), else ``None``."""
    dates: list[DateSpan] = []
    """The spans the query names (``date_match`` on), relative ones included."""
    stages: dict[str, bool]
    """Each stage and whether it was on."""


def analyse(
    query: str,
    settings: QuerySettings,
    speakers: Collection[str] = (),
    now: datetime | None = None,
) -> QueryAnalysis:
    """The analysis of ``query``; ``speakers`` are the owner's known speakers, ``now`` the
    time it is asked at (dates relative to it: "yesterday", "last week")."""
    lexical_query = strip_stopwords(query) if settings.strip_stopwords else query
    named = named_speakers(query, speakers)
    vector_query = strip_names(query, named) if settings.strip_speakers else query
    if not _TOKEN.search(vector_query):
        vector_query = query
    return QueryAnalysis(
        query=query,
        lexical_query=lexical_query or query,
        vector_query=vector_query,
        entities=extract_entities(query),
        time_cue=time_cue(query) if settings.temporal_cues else None,
        dates=date_mentions(query, now) if settings.date_match else [],
        speakers=named if settings.speaker_match else [],
        stages={
            "strip_stopwords": settings.strip_stopwords,
            "temporal_cues": settings.temporal_cues,
            "date_match": settings.date_match,
            "speaker_match": settings.speaker_match,
            "strip_speakers": settings.strip_speakers,
        },
    )


def named_speakers(query: str, speakers: Collection[str]) -> list[str]:
    """The ``speakers`` that ``query`` names as whole words (any case, with or without
    accents: ``jose`` names ``José``), first named first."""
    folded, _origin = _folded(query)
    found = []
    for speaker in {s.strip() for s in speakers if s.strip()}:
        name = _folded(speaker)[0]
        match = _name_pattern([name]).search(folded) if name else None
        if match is not None:
            found.append((match.start(), speaker))
    return [speaker for _, speaker in sorted(found)]


def strip_names(query: str, names: Collection[str]) -> str:
    """``query`` without ``names`` (and their possessive ``'s``; any case, with or without
    accents), spaces collapsed."""
    folded_names = [name for name in (_folded(n.strip())[0] for n in names) if name]
    if not folded_names:
        return query
    folded, origin = _folded(query)
    kept: list[str] = []
    start = 0
    for match in _name_pattern(folded_names).finditer(folded):
        kept.append(query[start : origin[match.start()]])
        start = origin[match.end() - 1] + 1
        while start < len(query) and unicodedata.category(query[start]).startswith("M"):
            start += 1  # a decomposed accent of the name's last letter
    kept.append(query[start:])
    return " ".join(" ".join(kept).split())


def _folded(text: str) -> tuple[str, Sequence[int]]:
    """``text`` casefolded without its combining marks and folded to ASCII as the lexical
    index folds it (``ø`` is ``o``, ``ł`` is ``l``), and for each character of that the
    index in ``text`` of the character it comes from."""
    if text.isascii():
        return text.lower(), range(len(text))
    chars: list[str] = []
    origin: list[int] = []
    for index, char in enumerate(text):
        for part in unicodedata.normalize("NFKD", char):
            if unicodedata.category(part).startswith("M"):
                continue
            if not part.isascii():
                part = (_ASCII_FOLD.analyze(part) or [part])[0]
            for folded in part.casefold():
                chars.append(folded)
                origin.append(index)
    return "".join(chars), origin


_ASCII_FOLD: Final = (
    tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.raw()).filter(tantivy.Filter.ascii_fold()).build()
)
"""Tantivy's ASCII folding, the lexical index's, on one character at a time."""


def speaker_factor(analysis: QueryAnalysis, speaker: str | None, settings: QuerySettings) -> float:
    """``1 + speaker_boost`` when the query names the memory's speaker, else 1."""
    if speaker and any(speaker.casefold() == s.casefold() for s in analysis.speakers):
        return 1.0 + settings.speaker_boost
    return 1.0


def _name_pattern(names: Collection[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(n.strip()) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<!\w)(?:{alternatives})(?:['’]s)?(?!\w)", re.IGNORECASE)


def strip_stopwords(query: str) -> str:
    words = [w for w in _TOKEN.findall(query) if w.lower().replace("’", "'") not in STOPWORDS]
    return " ".join(words)
