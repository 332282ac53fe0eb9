"""The derivation shortcuts (skipped extractors, lower-cased ASCII matching, the plain-word
fast path) give exactly what the plain rules give: a replay must derive the same nodes."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from prme.projectors import node_types
from prme.projectors.entities import _extract
from prme.projectors.node_types import classify_node_type

DATA = Path(__file__).parent / "data" / "locomo_tiny" / "tiny.json"

TRICKY = [
    "We met on May 7, 2023 and again on 7th of May 2023; then June 2024 and 2023-05-07.",
    "MAY 3RD at Noon, SEPT. 9 and 12 Dec 2021 for the March of Dimes.",
    "It cost $3K, then €5.50 and 10 PERCENT more; I ran 5KM in 30 Minutes over 3 Weeks.",
    "ſeptember 5 and the K\u212aelvin Sign: the İstanbul trip on May 7 2023 cost 10 percent",
    "We watched \"The Lord of the Rings\" and 'Hamlet', then read “Dune” and ‘Emma’.",
    "Dr. Smith and Caroline's friend visited the Bank of America tower in New York.",
    "Thanks! The weather is nice. I think so. What a day! Hello there, Jon.",
    "We decided to go with Postgres. Don't forget the deadline! I'd rather not. Is it?",
    "i’m into jazz; I’d rather WAIT. We Will Go With plan B",
    "GOING WITH it; a To-Do, DUE ON friday; my favourite, fan of it; Settled On x; lets use y",
    "",
    "12345 67 8.5% 2023-13-45 2023-02-31 mar 33 Mar. 3rd, 2020",
    "It cost $3K and 10 PERCENT more, 5 per cent less, 7% off on 2023-05-07; 20 percentile",
]


def _texts() -> list[str]:
    texts = list(TRICKY)
    for conversation in json.loads(DATA.read_text()):
        for value in _strings(conversation):
            texts.append(value)
    rng = random.Random(7)
    words = " ".join(texts).split()
    for _ in range(300):
        picked = rng.sample(words, min(len(words), rng.randint(1, 40)))
        texts.append(" ".join(word.upper() if rng.random() < 0.1 else word for word in picked))
    return texts


def _strings(value: object) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    return []


def test_entity_shortcuts_find_what_the_plain_rules_find() -> None:
    texts = _texts()
    assert len(texts) > 300
    for text in texts:
        assert _extract(text, fast=True) == _extract(text, fast=False), text


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "a",
                "Z",
                "é",
                "É",
                "ß",
                "İ",
                "x1",
                "9",
                "_",
                "'",
                "’",
                "-",
                " ",
                "  ",
                ".",
                "?",
                "\n",
                '"',
                "of",
                "Of",
                "the",
                "The",
                "i'm",
                "Dr.",
                "Bank",
                "May",
                "'s",
                "²",
                "ǅ",
                "Ⓐ",
                "中",
                "$3",
                "%",
                "\u0301",
            ]
        ),
        max_size=30,
    ).map("".join)
)
def test_entity_shortcuts_agree_on_text_made_of_awkward_pieces(text: str) -> None:
    assert _extract(text, fast=True) == _extract(text, fast=False)


def test_node_type_shortcut_matches_the_case_insensitive_rules() -> None:
    plain = [
        re.compile(p.pattern, re.IGNORECASE)
        for p in (node_types._DECISION, node_types._TASK, node_types._PREFERENCE)
    ]
    fact = re.compile(node_types._FACT.pattern, re.IGNORECASE)

    def reference(text: str, role: str) -> str:
        normal = text.replace("’", "'")
        for pattern, kind in zip(plain, ("decision", "task", "preference"), strict=True):
            if pattern.search(normal):
                return kind
        stripped = normal.strip()
        if stripped.endswith("?"):
            return "note"
        if fact.search(normal) or (role in ("tool", "function") and stripped):
            return "fact"
        return "note"

    for text in _texts():
        for role in ("user", "tool"):
            assert classify_node_type(text, role) == reference(text, role), text


def _cues(pattern: re.Pattern[str]) -> list[str]:
    """Every phrase a ``\\b(?:a|b|...)\\b`` cue pattern matches (``x?`` both ways)."""
    body = pattern.pattern.split(r"\b(?:", 1)[1].split(r")\b", 1)[0]
    phrases: list[str] = []
    for alternative in body.split("|"):
        variants = [alternative]
        while any("?" in v for v in variants):
            variants = [
                form
                for v in variants
                for form in (
                    (v[: v.index("?") - 1] + v[v.index("?") + 1 :], v.replace("?", "", 1))
                    if "?" in v
                    else (v,)
                )
            ]
        phrases.extend(variants)
    return phrases


def test_every_cue_holds_a_string_its_shortcut_looks_for() -> None:
    patterns = (node_types._DECISION, node_types._TASK, node_types._PREFERENCE)
    for pattern, needed in zip(patterns, node_types._NEEDED, strict=True):
        cues = _cues(pattern)
        assert len(cues) >= 10 and all(re.fullmatch(r"[a-z' -]+", cue) for cue in cues)
        for cue in cues:
            assert any(part in cue for part in needed), cue
            assert re.search(pattern, cue), cue


def test_hashed_provider_vectors_match_the_plain_recipe() -> None:
    import hashlib
    import math

    from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider

    def reference(text: str, dimension: int) -> list[float]:
        values = [0.0] * dimension
        for word in re.findall(r"\w+", text.lower()):
            digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
            slot = int.from_bytes(digest[:4], "little") % dimension
            values[slot] += 1.0 if digest[4] & 1 else -1.0
        norm = math.sqrt(sum(value * value for value in values))
        if norm == 0.0:
            values[0] = 1.0
            return values
        return [value / norm for value in values]

    provider = HashedBagOfWordsProvider(dimension=384)
    texts = [*_texts(), "a a", "x y x y", "", "İstanbul ſ"]
    for _ in range(2):  # the second pass reads the provider's word cache
        for text in texts:
            assert provider.vector(text) == reference(text, 384), text
