"""Node derivation: entities, node types and the derived memory node."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import pytest

from prme.projectors.derive import derive_node
from prme.projectors.entities import extract_entities, normalise_entity
from prme.projectors.node_types import classify_node_type
from prme.schemas.records import Message

AT = datetime(2024, 3, 1, 12, 0, tzinfo=UTC)


def test_names_and_places_are_casefolded_in_first_seen_order() -> None:
    text = "Yesterday Caroline went to the LGBTQ support group in New York with Melanie."
    assert extract_entities(text) == ["caroline", "lgbtq", "new york", "melanie"]


def test_sentence_initial_common_words_and_pronoun_i_are_not_entities() -> None:
    text = "Thanks! The weather is nice. I think so. What a day! Hello there, Jon."
    assert extract_entities(text) == ["jon"]


def test_connectors_join_phrases_and_possessives_and_titles_are_stripped() -> None:
    text = "Dr. Smith and Caroline's friend visited the Bank of America tower."
    assert extract_entities(text) == ["smith", "caroline", "bank of america"]


def test_quoted_titles_are_entities() -> None:
    text = "We watched \"The Lord of the Rings\" and 'Hamlet', then read “Dune”."
    assert extract_entities(text) == ["the lord of the rings", "hamlet", "dune"]


def test_apostrophes_are_not_quotes() -> None:
    assert extract_entities("I can't go, it's my kids' day") == []


def test_numbers_with_units_currency_and_percentages() -> None:
    text = "I ran 5km in 30 minutes, paid $20 and got 10 percent off for 3 weeks."
    assert extract_entities(text) == ["5 km", "30 minutes", "$20", "10%", "3 weeks"]


def test_dates_are_normalised_to_iso_when_complete() -> None:
    text = "On May 7, 2023 and 8th of May 2023, then 2023-05-09, in June 2024 and on may 3rd."
    assert extract_entities(text) == [
        "2023-05-07",
        "2023-05-08",
        "2023-05-09",
        "2024-06",
        "may 3",
    ]


def test_extraction_is_deterministic_and_unique() -> None:
    text = "Paris is lovely. I went to Paris with Anna and anna's dog."
    first = extract_entities(text)
    assert first == extract_entities(text) == ["paris", "anna"]


def test_normalise_entity_collapses_whitespace() -> None:
    assert normalise_entity("  New\t York ") == "new york"


@pytest.mark.parametrize(
    ("text", "role", "expected"),
    [
        ("We decided to use Postgres.", "user", "decision"),
        ("Let's use Kafka for the log", "assistant", "decision"),
        ("We'll go with the blue one", "user", "decision"),
        ("Remind me to call mom tomorrow", "user", "task"),
        ("TODO: fix the sink", "user", "task"),
        ("I need to renew my passport", "user", "task"),
        ("I prefer tea over coffee", "user", "preference"),
        ("My favorite band is Queen", "user", "preference"),
        ("I love hiking", "user", "preference"),
        ("Is Paris lovely in spring?", "user", "note"),
        ("Paris is the capital of France", "user", "fact"),
        ("I ran 5 km", "user", "fact"),
        ("Sounds good to me", "user", "note"),
        ("42 rows updated", "tool", "fact"),
        ("ok", "tool", "fact"),
        ("Hello there", "assistant", "note"),
    ],
)
def test_node_type_cue_rules(text: str, role: str, expected: str) -> None:
    assert classify_node_type(text, role) == expected


def test_decision_cue_wins_over_task_and_preference() -> None:
    assert classify_node_type("We decided we need to use what I prefer", "user") == "decision"


def test_derive_node_from_message() -> None:
    record = Message(
        event_id="evt-1",
        owner="alice",
        session_id="s1",
        scope="work",
        recorded_at=AT,
        occurred_at=AT,
        role="user",
        name="Alice",
        content=[{"type": "text", "text": "I prefer Berlin"}, {"type": "image_url"}],
    )
    node = derive_node(record)
    assert node.node_id == "mem:evt-1"
    assert (node.event_id, node.owner, node.session_id, node.scope) == (
        "evt-1",
        "alice",
        "s1",
        "work",
    )
    assert node.text == "I prefer Berlin"
    assert node.speaker == "Alice"
    assert node.role == "user"
    assert node.entities == ["berlin"]
    assert node.node_type == "preference"
    assert node.recorded_at == AT and node.occurred_at == AT
    assert node.content_hash == hashlib.sha256(b"I prefer Berlin").hexdigest()


def test_derive_node_without_name_has_no_speaker() -> None:
    record = Message(event_id="evt-2", owner="bob", recorded_at=AT, role="assistant", content="Hi")
    node = derive_node(record)
    assert node.speaker is None
    assert node.occurred_at is None
    assert derive_node(record) == node
