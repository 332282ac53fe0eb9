"""Query analysis stages: stopwords, time cues, date mentions, and the time factor."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from prme.query.analysis import (
    analyse,
    named_speakers,
    speaker_factor,
    strip_names,
    strip_stopwords,
)
from prme.query.retrieve import boosted, time_factor
from prme.query.temporal import date_mentions, has_time_expression, time_cue
from prme.schemas.config import QuerySettings

ON = QuerySettings()
SWITCHES = ("strip_stopwords", "temporal_cues", "date_match", "speaker_match", "strip_speakers")
OFF = QuerySettings(**dict.fromkeys(SWITCHES, False))
"""Every analysis switch off."""


def test_strip_stopwords_keeps_content_words_only() -> None:
    assert strip_stopwords("What did Caroline paint after the trip?") == "Caroline paint trip"
    assert strip_stopwords("Would Melanie likely enjoy what's there?") == "Melanie enjoy"


def test_lexical_query_falls_back_to_the_query_when_all_words_are_stopwords() -> None:
    assert analyse("what is it?", ON).lexical_query == "what is it?"


@pytest.mark.parametrize(
    ("query", "cue"),
    [
        ("When did Ben run a marathon?", "when"),
        ("How long   has she played the cello?", "how long"),
        ("In what year did they move?", "what year"),
        ("How many weeks did the course last?", "how many weeks"),
        ("What did Ava name her cat?", None),
        ("Whenever possible?", None),
    ],
)
def test_time_cue(query: str, cue: str | None) -> None:
    assert time_cue(query) == cue


def test_date_mentions_parse_days_months_and_years() -> None:
    spans = date_mentions("What happened on 8 May, 2023, in June 2023 or in 2022?")
    assert [(s.text, s.start.date().isoformat(), s.end.date().isoformat()) for s in spans] == [
        ("8 May, 2023", "2023-05-08", "2023-05-09"),
        ("June 2023", "2023-06-01", "2023-07-01"),
        ("2022", "2022-01-01", "2023-01-01"),
    ]


def test_date_mentions_handle_month_first_and_december() -> None:
    (day,) = date_mentions("Was it December 31st, 2023?")
    assert day.start == datetime(2023, 12, 31, tzinfo=UTC)
    (month,) = date_mentions("during Dec 2023")
    assert month.end == datetime(2024, 1, 1, tzinfo=UTC)


def test_date_mentions_ignore_numbers_that_are_not_dates_and_impossible_days() -> None:
    assert date_mentions("She ran 2500 metres and scored 12/2023") == []
    assert [span.text for span in date_mentions("31 February 2023")] == ["February 2023"]


MONDAY = datetime(2026, 12, 7, 15, 30, tzinfo=UTC)


@pytest.mark.parametrize(
    ("query", "span"),
    [
        ("What did I say yesterday?", ("yesterday", "2026-12-06", "2026-12-07")),
        ("what did we do today", ("today", "2026-12-07", "2026-12-08")),
        ("and the day before yesterday?", ("the day before yesterday", "2026-12-05", "2026-12-06")),
        ("my plans for last week", ("last week", "2026-11-30", "2026-12-07")),
        ("what is on this week", ("this week", "2026-12-07", "2026-12-14")),
        ("what did I do last weekend", ("last weekend", "2026-12-05", "2026-12-07")),
        ("anything from last month?", ("last month", "2026-11-01", "2026-12-01")),
        ("goals for this year", ("this year", "2026-01-01", "2027-01-01")),
        ("what did I read in the past week", ("the past week", "2026-11-30", "2026-12-08")),
        ("who called 3 days ago", ("3 days ago", "2026-12-04", "2026-12-05")),
        ("the trip two weeks ago", ("two weeks ago", "2026-11-23", "2026-11-30")),
        ("a month ago I moved", ("a month ago", "2026-11-01", "2026-12-01")),
        ("14 months ago", ("14 months ago", "2025-10-01", "2025-11-01")),
        ("Last Year", ("Last Year", "2025-01-01", "2026-01-01")),
    ],
)
def test_date_mentions_relative_to_the_time_asked(query: str, span: tuple[str, ...]) -> None:
    (found,) = date_mentions(query, MONDAY)
    assert (found.text, found.start.date().isoformat(), found.end.date().isoformat()) == span


def test_date_mentions_read_iso_dates_not_their_year() -> None:
    """Before, "2026-12-01" named the whole of 2026: every memory of the year was boosted."""
    (day,) = date_mentions("what did i do on 2026-12-01?")
    assert (day.text, day.start, day.end, day.relative) == (
        "2026-12-01",
        datetime(2026, 12, 1, tzinfo=UTC),
        datetime(2026, 12, 2, tzinfo=UTC),
        False,
    )
    (month,) = date_mentions("the invoices of 2026-11")
    assert (month.start, month.end) == (
        datetime(2026, 11, 1, tzinfo=UTC),
        datetime(2026, 12, 1, tzinfo=UTC),
    )
    assert date_mentions("2026-13-01 or 2026-02-30") == []  # no date, and not the year either
    assert [s.text for s in date_mentions("the 2019-2020 season")] == ["2019", "2020"]


@pytest.mark.parametrize(
    ("query", "span"),
    [
        ("what did I do on Friday?", ("on Friday", "2026-12-04")),
        ("what did I do on monday", ("on monday", "2026-12-07")),
        ("last Tuesday", ("last Tuesday", "2026-12-01")),
        ("last Monday", ("last Monday", "2026-11-30")),
        ("this past Sunday", ("this past Sunday", "2026-12-06")),
        ("on 1 December", ("1 December", "2026-12-01")),
        ("the 1st of December", ("1st of December", "2026-12-01")),
        ("Dec 1st", ("Dec 1st", "2026-12-01")),
        ("since December 25", ("December 25", "2025-12-25")),
        ("Feb 29", ("Feb 29", "2024-02-29")),
        ("at 10:30 on May 3", ("May 3", "2026-05-03")),
    ],
)
def test_date_mentions_read_weekdays_and_days_without_a_year(
    query: str, span: tuple[str, str]
) -> None:
    """A weekday or a day of a month without its year is its latest date up to the day asked
    (a Monday here), one UTC day with no slack."""
    (found,) = date_mentions(query, MONDAY)
    assert (found.text, found.start.date().isoformat()) == span
    assert found.end - found.start == timedelta(days=1)
    assert found.relative


def test_weekdays_and_yearless_days_need_the_time_asked_and_the_month() -> None:
    assert date_mentions("on Friday, Dec 1st") == []
    assert date_mentions("may 7 people come?", MONDAY) == []  # the verb
    assert date_mentions("what do I do on Fridays?", MONDAY) == []  # every Friday
    assert date_mentions("Feb 30", MONDAY) == []
    # A year written beside the day makes it a calendar date, which no slack-less day beats.
    (calendar,) = date_mentions("May 3 2023", MONDAY)
    assert (calendar.start, calendar.relative) == (datetime(2023, 5, 3, tzinfo=UTC), False)
    assert date_mentions("May 3 1850", MONDAY) == []


def test_relative_mentions_need_the_time_asked_and_yield_to_calendar_dates() -> None:
    assert date_mentions("What did I say yesterday?") == []
    assert date_mentions("1,000 days ago and 2.5 weeks ago", MONDAY) == []
    spans = date_mentions("the last week of May 2023, and today", MONDAY)
    assert [s.text for s in spans] == ["May 2023", "today"]
    # A time zone is read in UTC: 23:30 on Sunday at UTC-2 is Monday 01:30 UTC.
    sunday_evening = datetime(2026, 12, 6, 23, 30, tzinfo=timezone(timedelta(hours=-2)))
    (today,) = date_mentions("today", sunday_evening)
    assert today.start == datetime(2026, 12, 7, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I went there yesterday", True),
        ("We met 3 years ago", True),
        ("Back in June it rained", True),
        ("It was on 5/7", True),
        ("I love painting sunsets", False),
    ],
)
def test_has_time_expression(text: str, expected: bool) -> None:
    assert has_time_expression(text) is expected


def test_stages_are_reported_and_switchable() -> None:
    query = "When did Caroline go to the support group in May 2023?"
    on = analyse(query, ON)
    assert on.stages == {
        "strip_stopwords": True,
        "temporal_cues": True,
        "date_match": True,
        "speaker_match": True,
        "strip_speakers": True,
    }
    assert on.lexical_query == "Caroline go support group May 2023"
    assert on.time_cue == "when"
    assert [span.text for span in on.dates] == ["May 2023"]
    off = analyse(query, OFF)
    assert off.stages == dict.fromkeys(on.stages, False)
    assert (off.lexical_query, off.time_cue, off.dates) == (query, None, [])


def test_time_factor_multiplies_cue_and_date_boosts() -> None:
    settings = QuerySettings(time_boost=0.5, date_boost=1.0, date_slack_days=7)
    analysis = analyse("When did she move in May 2023?", settings)
    in_may = datetime(2023, 5, 20, tzinfo=UTC)
    after_slack = datetime(2023, 6, 9, tzinfo=UTC)
    assert time_factor(analysis, "we moved last week", in_may, settings) == 3.0
    assert time_factor(analysis, "we moved", in_may, settings) == 2.0
    assert time_factor(analysis, "we moved yesterday", after_slack, settings) == 1.5
    assert time_factor(analysis, "we moved", None, settings) == 1.0


def test_time_factor_is_one_when_stages_are_off() -> None:
    analysis = analyse("When did she move in May 2023?", OFF)
    assert time_factor(analysis, "last week", datetime(2023, 5, 2, tzinfo=UTC), ON) == 1.0


def test_named_speakers_are_whole_words_in_any_case_first_named_first() -> None:
    speakers = ["Melanie", "Caroline", "Mel", "Al", " "]
    assert named_speakers("Did melanie call Caroline's mom?", speakers) == ["Melanie", "Caroline"]
    assert named_speakers("What did Mel say?", speakers) == ["Mel"]
    assert named_speakers("What did Alice buy?", speakers) == []


def test_a_name_is_named_with_or_without_its_accents() -> None:
    """The lexical channel folds accents; the speaker stages did not, so ``jose`` did not
    name the speaker ``José`` (nor ``Renee`` ``Renée``)."""
    speakers = ["José", "Zoë", "Renée", "Melanie"]
    assert named_speakers("what did jose and ZOE say?", speakers) == ["José", "Zoë"]
    assert named_speakers("Did Renée call?", ["Renee"]) == ["Renee"]
    assert strip_names("What did jose tell Renée's friend?", ["José", "Renée"]) == (
        "What did tell friend?"
    )
    assert strip_names("¿Qué dijo JOSÉ de Zoë?", ["José", "Zoë"]) == "¿Qué dijo de ?"
    assert strip_names("Did Joseph call?", ["José"]) == "Did Joseph call?"
    # Folded as the lexical index folds them (a re-trial: soren found Søren lexically only).
    assert named_speakers("what did soren and lukasz say", ["Søren", "Łukasz"]) == [
        "Søren",
        "Łukasz",
    ]
    assert strip_names("what did Jose\u0301 say", ["Jose\u0301"]) == "what did say"


def test_a_word_of_the_query_starts_with_a_letter_or_digit() -> None:
    """A re-trial: ``❤️`` left its invisible variation selector as the lexical query."""
    assert strip_stopwords("❤️") == ""
    assert strip_stopwords("मैं हिन्दी पढ़ता") == "मैं हिन्दी पढ़ता"


def test_strip_names_removes_names_and_their_possessive() -> None:
    query = "What did Caroline’s friend tell Melanie?"
    assert strip_names(query, ["Caroline", "Melanie"]) == "What did friend tell ?"
    assert strip_names(query, []) == query


def test_speaker_stages_give_the_vector_query_and_the_speakers() -> None:
    speakers = ["Caroline", "Melanie"]
    on = analyse("What did Caroline paint?", ON, speakers)
    assert (on.vector_query, on.speakers) == ("What did paint?", ["Caroline"])
    assert on.lexical_query == "Caroline paint"
    off = analyse("What did Caroline paint?", OFF, speakers)
    assert (off.vector_query, off.speakers) == ("What did Caroline paint?", [])
    assert analyse("Caroline?", ON, speakers).vector_query == "Caroline?"
    assert analyse("What did Caroline paint?", ON).speakers == []


def test_speaker_factor_boosts_only_the_named_speakers_memories() -> None:
    settings = QuerySettings(speaker_boost=0.5)
    analysis = analyse("What did Caroline paint?", settings, ["Caroline", "Melanie"])
    assert speaker_factor(analysis, "caroline", settings) == 1.5
    assert speaker_factor(analysis, "Melanie", settings) == 1.0
    assert speaker_factor(analysis, None, settings) == 1.0
    unnamed = analyse("What did Caroline paint?", OFF, ["Caroline"])
    assert speaker_factor(unnamed, "Caroline", settings) == 1.0


def test_a_boost_lifts_a_candidate_zscore_clipped_to_zero() -> None:
    """From a new-user trial: under zscore, candidates below a channel's mean fuse to 0,
    and a date match's factor times 0 left the memory from the named month under every
    positive candidate."""
    head = [("a", 1.4), ("b", 0.6), ("c", 0.2), ("may", 0.0), ("other", 0.0)]
    assert boosted(head, {"may": 2.0}) == [
        ("a", 1.4),
        ("b", 0.6),
        ("may", 0.4),  # the lowest positive score (0.2), doubled
        ("c", 0.2),
        ("other", 0.0),
    ]
    assert boosted(head, {"a": 2.0}) == [(n, s * 2 if n == "a" else s) for n, s in head]
    assert boosted([("x", 0.0), ("y", 0.0)], {"y": 2.0}) == [("x", 0.0), ("y", 0.0)]
