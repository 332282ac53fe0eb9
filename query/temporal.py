"""Time in queries and memories: cues, date mentions and time expressions (English).

- :func:`time_cue`: the phrase that makes a question ask for a time ("when", "how long",
  "what year" ...), or ``None``.
- :func:`date_mentions`: the calendar spans a query names ("8 May 2023", "May 2023",
  "in 2022"), as half-open UTC intervals.
- :func:`has_time_expression`: whether a memory's text states a time ("yesterday",
  "last week", "in June", "2019", "3 years ago" ...).

Pure functions over text: no clock, no locale, no state.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Final

import msgspec

from prme.projectors.entities import MONTHS

_MONTH: Final = (
    r"(?P<month>january|february|march|april|may|june|july|august|september|october|"
    r"november|december|jan|feb|mar|apr|jun|jul|aug|sept|sep|oct|nov|dec)\.?"
)
_DAY: Final = r"(?P<day>[0-3]?\d)(?:st|nd|rd|th)?"
_YEAR: Final = r"(?P<year>(?:19|20)\d\d)"

_CUE = re.compile(
    r"\b(?:when|how\s+long|since\s+when|how\s+recently|how\s+often|how\s+many\s+"
    r"(?:years|months|weeks|days|times)|what\s+(?:year|month|date|day|time|week)|"
    r"which\s+(?:year|month|date|day|week))\b",
    re.IGNORECASE,
)
_DATE_PATTERNS: Final = [
    re.compile(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH},?\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b{_MONTH}\s+{_DAY},?\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b{_MONTH},?\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b(?<![/\d]){_YEAR}(?![/\d])\b", re.IGNORECASE),
]
_WORDS_OF_TIME: Final = (
    r"yesterday|today|tonight|tomorrow|weekend|weekends|morning|evening|afternoon|"
    r"ago|recently|lately|since|last|next|earlier|later|week|weeks|month|months|year|years|"
    r"monday|tuesday|wednesday|thursday|friday|saturday|sunday|"
    r"spring|summer|autumn|fall|winter|christmas|birthday|anniversary|holiday|holidays"
)
_TIME_EXPRESSION = re.compile(
    rf"\b(?:{_WORDS_OF_TIME}|{_MONTH.replace('(?P<month>', '(?:')}|(?:19|20)\d\d)\b"
    r"|\b\d{1,2}[/.-]\d{1,2}(?:[/.-]\d{2,4})?\b",
    re.IGNORECASE,
)


class DateSpan(msgspec.Struct, frozen=True, kw_only=True):
    """A calendar span named in a query: ``[start, end)`` in UTC, and the text naming it."""

    text: str
    start: datetime
    end: datetime

    def contains(self, moment: datetime, slack: timedelta = timedelta(0)) -> bool:
        """Whether ``moment`` is in the span, extended by ``slack`` past its end."""
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return self.start <= moment < self.end + slack


def time_cue(query: str) -> str | None:
    """The phrase that asks for a time ("when", "how long" ...), lower-cased, or ``None``."""
    found = _CUE.search(query)
    return " ".join(found.group(0).lower().split()) if found else None


def has_time_expression(text: str) -> bool:
    return _TIME_EXPRESSION.search(text) is not None


def date_mentions(query: str) -> list[DateSpan]:
    """The spans a query names, most specific first; overlapping weaker mentions are dropped."""
    spans: list[DateSpan] = []
    taken: list[tuple[int, int]] = []
    for pattern in _DATE_PATTERNS:
        for found in pattern.finditer(query):
            where = found.span()
            if any(where[0] < end and start < where[1] for start, end in taken):
                continue
            span = _span(found)
            if span is not None:
                spans.append(span)
                taken.append(where)
    return spans


def _span(found: re.Match[str]) -> DateSpan | None:
    parts = found.groupdict()
    year = int(parts["year"])
    month = MONTHS[parts["month"].lower()] if parts.get("month") else None
    day = int(parts["day"]) if parts.get("day") else None
    try:
        if month is None:
            start = datetime(year, 1, 1, tzinfo=UTC)
            end = datetime(year + 1, 1, 1, tzinfo=UTC)
        elif day is None:
            start = datetime(year, month, 1, tzinfo=UTC)
            end = datetime(year + month // 12, month % 12 + 1, 1, tzinfo=UTC)
        else:
            start = datetime(year, month, day, tzinfo=UTC)
            end = start + timedelta(days=1)
    except ValueError:
        return None
    return DateSpan(text=found.group(0), start=start, end=end)
