"""Time in queries and memories: cues, date mentions and time expressions (English).

- :func:`time_cue`: the phrase that makes a question ask for a time ("when", "how long",
  "what year" ...), or ``None``.
- :func:`date_mentions`: the calendar spans a query names ("8 May 2023", "2023-05-08",
  "May 2023", "in 2022"), as half-open UTC intervals; given the time of the query, also
  those it names relative to it ("yesterday", "last week", "3 days ago", "on Friday",
  "Dec 1st").
- :func:`has_time_expression`: whether a memory's text states a time ("yesterday",
  "last week", "in June", "2019", "3 years ago" ...).

Pure functions over text: no clock (a caller passes the time a query is asked at), no
locale, no state.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
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
_ISO_DATE: Final = re.compile(
    rf"(?<![\d-]){_YEAR}-(?P<month_number>0[1-9]|1[0-2])(?:-(?P<day>[0-3]\d))?(?![\d-])"
)
"""``2023-05-08`` and ``2023-05`` (ISO 8601 calendar dates)."""
_DATE_PATTERNS: Final = [
    _ISO_DATE,
    re.compile(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH},?\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b{_MONTH}\s+{_DAY},?\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b{_MONTH},?\s+{_YEAR}\b", re.IGNORECASE),
    re.compile(rf"\b(?<![/\d]){_YEAR}(?![/\d]|-\d\d?(?!\d))\b", re.IGNORECASE),
]
_COUNT_WORDS: Final = {
    "a": 1,
    "an": 1,
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
}
_RELATIVE_PATTERNS: Final = [
    re.compile(r"\b(?P<day>the\s+day\s+before\s+yesterday|yesterday|today|tonight)\b", re.I),
    re.compile(r"\b(?P<which>this|last)\s+(?P<unit>weekend|week|month|year)\b(?!\s+of\b)", re.I),
    re.compile(r"\b(?:the\s+)?past\s+(?P<past>week|month|year)\b", re.I),
    re.compile(
        rf"(?<![\d,.])\b(?P<count>\d{{1,3}}|{'|'.join(_COUNT_WORDS)})\s+"
        r"(?P<units>day|week|month|year)s?"
        r"\s+ago\b",
        re.I,
    ),
]
_PAST_DAYS: Final = {"week": 7, "month": 30, "year": 365}
_WEEKDAYS: Final = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_DAY_OF_YEAR_PATTERNS: Final = [
    re.compile(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH}(?!\w)", re.I),
    re.compile(rf"\b{_MONTH}\s+{_DAY}\b(?!,?\s*\d{{4}})", re.I),
]
"""A day of a month without its year ("Dec 1st", "1 December"): its latest date up to the
day asked."""
_WEEKDAY_PATTERN: Final = re.compile(
    rf"\b(?P<weekday_which>last|on|this\s+past)\s+(?P<weekday>{'|'.join(_WEEKDAYS)})\b(?!s)",
    re.I,
)
"""``on Friday`` (the latest Friday up to the day asked), ``last Friday`` and ``this past
Friday`` (the latest before it)."""

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
    relative: bool = False
    """Named relative to the time asked ("yesterday"): no slack extends it (it would reach
    the present, where every recent memory lies)."""

    def contains(self, moment: datetime, slack: timedelta = timedelta(0)) -> bool:
        """Whether ``moment`` is in the span, extended by ``slack`` past its end (a
        calendar span only)."""
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return self.start <= moment < self.end + (timedelta(0) if self.relative else slack)


def time_cue(query: str) -> str | None:
    """The phrase that asks for a time ("when", "how long" ...), lower-cased, or ``None``."""
    found = _CUE.search(query)
    return " ".join(found.group(0).lower().split()) if found else None


def has_time_expression(text: str) -> bool:
    return _TIME_EXPRESSION.search(text) is not None


def date_mentions(query: str, now: datetime | None = None) -> list[DateSpan]:
    """The spans a query names, most specific first; overlapping weaker mentions are dropped.
    With ``now`` (the time the query is asked at), the spans it names relative to that
    too, in UTC days: "today", "yesterday", "the day before yesterday", "this/last week"
    (Monday to Sunday), "this/last weekend", "this/last month", "this/last year", "the past
    week/month/year" (the last 7, 30 or 365 days and today), "N days/weeks/months/years
    ago" (that day; the week, month or year it falls in), "on Friday" (the latest Friday up
    to today), "last Friday" and "this past Friday" (the latest one before today), and a
    day of a month without its year, "Dec 1st" or "1 December" (its latest date up to
    today; "may" in lower case is the verb, not the month)."""
    spans: list[DateSpan] = []
    taken: list[tuple[int, int]] = []
    readers: list[tuple[re.Pattern[str], Callable[[re.Match[str]], DateSpan | None]]] = [
        (pattern, _span) for pattern in _DATE_PATTERNS
    ]
    if now is not None:
        moment = now.astimezone(UTC) if now.tzinfo else now.replace(tzinfo=UTC)
        today = datetime(moment.year, moment.month, moment.day, tzinfo=UTC)
        relative = functools.partial(_relative_span, today=today)
        readers += [(pattern, relative) for pattern in _RELATIVE_PATTERNS]
        day_of_year = functools.partial(_day_of_year_span, today=today)
        readers += [(pattern, day_of_year) for pattern in _DAY_OF_YEAR_PATTERNS]
        readers.append((_WEEKDAY_PATTERN, functools.partial(_weekday_span, today=today)))
    for pattern, span_of in readers:
        for found in pattern.finditer(query):
            where = found.span()
            if any(where[0] < end and start < where[1] for start, end in taken):
                continue
            span = span_of(found)
            if span is not None:
                spans.append(span)
                taken.append(where)
    return spans


def _relative_span(found: re.Match[str], today: datetime) -> DateSpan | None:
    """The span ``found`` (one of :data:`_RELATIVE_PATTERNS`) names, ``today`` being the
    start of the query's UTC day."""
    parts = {name: value.lower() for name, value in found.groupdict().items() if value}
    day = timedelta(days=1)
    if "day" in parts:
        back = {"today": 0, "tonight": 0, "yesterday": 1}.get(parts["day"], 2)
        start, end = today - back * day, today - (back - 1) * day
    elif "past" in parts:
        start, end = today - _PAST_DAYS[parts["past"]] * day, today + day
    elif "which" in parts:
        back = 1 if parts["which"] == "last" else 0
        start, end = _unit_span(parts["unit"], today, back)
    else:
        count = int(parts["count"]) if parts["count"].isdigit() else _COUNT_WORDS[parts["count"]]
        unit = parts["units"]
        if unit == "day":
            start, end = today - count * day, today - (count - 1) * day
        else:
            start, end = _unit_span(unit, today, count)
    return DateSpan(text=found.group(0), start=start, end=end, relative=True)


def _day_of_year_span(found: re.Match[str], today: datetime) -> DateSpan | None:
    """The latest date up to ``today`` of the day and month ``found`` names."""
    if found["month"] == "may":
        return None
    month, day = MONTHS[found["month"].lower()], int(found["day"])
    for year in (today.year, today.year - 1, today.year - 2, today.year - 3, today.year - 4):
        try:
            start = datetime(year, month, day, tzinfo=UTC)
        except ValueError:  # 30 February; 29 February outside a leap year
            continue
        if start <= today:
            return DateSpan(
                text=found.group(0), start=start, end=start + timedelta(days=1), relative=True
            )
    return None


def _weekday_span(found: re.Match[str], today: datetime) -> DateSpan:
    """The day ``found`` ("on/last/this past <weekday>") names, ``today`` being the start
    of the query's UTC day."""
    back = (today.weekday() - _WEEKDAYS.index(found["weekday"].lower())) % 7
    if back == 0 and found["weekday_which"].lower() != "on":
        back = 7
    start = today - timedelta(days=back)
    return DateSpan(text=found.group(0), start=start, end=start + timedelta(days=1), relative=True)


def _unit_span(unit: str, today: datetime, back: int) -> tuple[datetime, datetime]:
    """The calendar week (Monday on), weekend, month or year ``back`` of them before the
    one holding ``today``."""
    if unit in ("week", "weekend"):
        monday = today - timedelta(days=today.weekday() + 7 * back)
        if unit == "weekend":
            return monday + timedelta(days=5), monday + timedelta(days=7)
        return monday, monday + timedelta(days=7)
    if unit == "month":
        index = today.year * 12 + today.month - 1 - back
        start = datetime(index // 12, index % 12 + 1, 1, tzinfo=UTC)
        following = index + 1
        return start, datetime(following // 12, following % 12 + 1, 1, tzinfo=UTC)
    year = today.year - back
    return datetime(year, 1, 1, tzinfo=UTC), datetime(year + 1, 1, 1, tzinfo=UTC)


def _span(found: re.Match[str]) -> DateSpan | None:
    parts = found.groupdict()
    year = int(parts["year"])
    if parts.get("month_number"):
        month: int | None = int(parts["month_number"])
    else:
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
