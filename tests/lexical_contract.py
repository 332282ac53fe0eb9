"""The lexical index contract: every implementation's test class subclasses
``LexicalIndexContract`` and provides the ``make_index`` fixture.

``make_index(store="a", settings=None)`` opens the index named ``store`` (creating it the
first time; ``None``: the default settings); calling it again with the same name after
``close()`` reopens that index. The fixture closes whatever is still open when the test ends.
Tantivy is the one implementation today, so ``LexicalModel`` names the interface; a second
implementation would turn it into a protocol in ``prme.projectors``.
"""

from __future__ import annotations

import random
import unicodedata
from typing import Protocol

import pytest
import tantivy

from prme.projectors.stores.lexical import LexicalHit, LexicalModel
from prme.projectors.stores.lexical_windows import LexicalDocument
from prme.schemas.config import LexicalSettings

from .record_builders import RecordLog


def legacy_schema(*, fast_ids: bool = True) -> tantivy.Schema:
    """The lexical schema as builds before 2026-12-07 wrote it (``en_stem`` search fields),
    with the id fast fields or, as before those, without."""
    builder = tantivy.SchemaBuilder()
    for name in ("node_id", "owner", "scope", "session_id", "state"):
        builder.add_text_field(name, stored=True, tokenizer_name="raw", index_option="basic")
    builder.add_text_field("text", stored=True, tokenizer_name="en_stem", index_option="position")
    builder.add_text_field("context", stored=True, tokenizer_name="en_stem", index_option="freq")
    builder.add_text_field("speaker", stored=True, tokenizer_name="en_stem", index_option="freq")
    builder.add_integer_field("offset", stored=True, indexed=True)
    if fast_ids:
        builder.add_integer_field("node_id_high", fast=True)
        builder.add_integer_field("node_id_low", fast=True)
    return builder.build()


class MakeIndex(Protocol):
    def __call__(
        self, store: str = "a", settings: LexicalSettings | None = None
    ) -> LexicalModel: ...


def ids(hits: list[LexicalHit]) -> list[str]:
    return [hit.node_id for hit in hits]


def docs_by_id(model: LexicalModel) -> dict[str, LexicalDocument]:
    return {document.node_id: document for document in model.documents()}


def contexts(model: LexicalModel, *node_ids: str) -> list[str]:
    """The window text (``context``) of each of ``node_ids``, in order."""
    documents = docs_by_id(model)
    return [documents[node_id].context for node_id in node_ids]


def full_log() -> RecordLog:
    log = RecordLog()
    rng = random.Random(7)
    words = ["trip", "paris", "dog", "pottery", "camping", "guitar", "book", "school"]
    nodes: list[str] = []
    for n in range(60):
        owner = rng.choice(["alice", "bob"])
        session = rng.choice(["s1", "s2"])
        text = " ".join(rng.choices(words, k=4))
        nodes.append(
            log.message(owner, text, session=session, speaker=rng.choice(["Ann", "Ben", None]))
        )
        if n % 13 == 5:
            log.clear(owner, session)
        if n % 11 == 7:
            victim = nodes[rng.randrange(len(nodes))]
            log.delete("alice", victim, session)
            log.delete("bob", victim, session)
        if n % 9 == 4:
            log.archive("alice", nodes[-2])
        if n == 40:
            log.erase("bob")
    return log


class LexicalIndexContract:
    """Behaviour every lexical index implementation must have."""

    @pytest.fixture
    def make_index(self) -> MakeIndex:
        raise NotImplementedError("subclasses provide make_index")

    @pytest.fixture
    def model(self, make_index: MakeIndex) -> LexicalModel:
        return make_index()

    @pytest.fixture
    def log(self) -> RecordLog:
        """An empty log for the test's records."""
        return RecordLog()

    def test_bm25_ranks_the_more_relevant_message_first(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        hiking = log.message("alice", "We went hiking in the mountains and hiking again in spring")
        once = log.message(
            "alice", "The weekend was quiet, some hiking and lots of reading", session="s2"
        )
        log.message("alice", "I bought a new espresso machine", session="s3")
        model.apply(log.records)

        hits = model.search("mountain hikes", "alice", None, 10)

        assert ids(hits) == [hiking, once]
        assert hits[0].score > hits[1].score > 0

    def test_another_owners_documents_are_never_returned(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        mine = log.message("alice", "my passport number is in the drawer")
        log.message("bob", "my passport number is in the drawer, passport passport")
        model.apply(log.records)

        assert ids(model.search("passport drawer", "alice", None, 10)) == [mine]
        assert model.search("passport", "carol", None, 10) == []

    def test_owner_and_scope_clauses_add_no_score(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        alice = log.message("alice", "the garden tomatoes ripened early", session="a")
        for n in range(5):
            log.message("bob", "the garden tomatoes ripened early", session=f"b{n}")
        model.apply(log.records)

        alice_hit = model.search("garden tomatoes", "alice", None, 10)
        bob_hits = model.search("garden tomatoes", "bob", None, 10)
        scoped = model.search("garden tomatoes", "alice", "default", 10)

        assert ids(alice_hit) == [alice]
        # The owner term is rarer for alice than for bob: a scoring owner clause would differ.
        assert {hit.score for hit in bob_hits} == {alice_hit[0].score}
        assert scoped == alice_hit

    def test_scope_filter_keeps_other_scopes_out(self, model: LexicalModel, log: RecordLog) -> None:
        work = log.message("alice", "quarterly budget review on friday", scope="work")
        home = log.message("alice", "budget for the holiday trip", scope="home")
        model.apply(log.records)

        assert ids(model.search("budget", "alice", "work", 10)) == [work]
        assert ids(model.search("budget", "alice", "home", 10)) == [home]
        assert set(ids(model.search("budget", "alice", None, 10))) == {work, home}

    def test_window_holds_two_before_and_one_after_and_grows_when_a_later_message_arrives(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        first, second, third, fourth = log.messages("alice", "one", "two", "three", "four")
        model.apply(log.records)
        assert docs_by_id(model)[fourth].context == "two\nthree"
        assert docs_by_id(model)[third].context == "one\ntwo\nfour"
        assert docs_by_id(model)[first].context == "two"

        fifth = log.message("alice", "five")
        model.apply(log.records[-1:])

        documents = docs_by_id(model)
        assert documents[fourth].context == "two\nthree\nfive"
        assert documents[fifth].context == "three\nfour"
        assert documents[second].context == "one\nthree"
        assert documents[fourth].text == "four"

    def test_window_settings_are_honoured(self, make_index: MakeIndex, log: RecordLog) -> None:
        nodes = log.messages("alice", "a1", "b2", "c3", "d4", "e5")
        with make_index("lex", LexicalSettings(window_before=1, window_after=2)) as wide:
            wide.apply(log.records)
            assert docs_by_id(wide)[nodes[1]].context == "a1\nc3\nd4"

    def test_neighbour_text_makes_a_message_findable_but_own_text_weighs_more(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        question = log.message("alice", "what did you make in class?", speaker="Mel")
        answer = log.message("alice", "a bowl, I painted it blue", speaker="Caroline")
        log.message("alice", "lovely!", speaker="Mel")
        model.apply(log.records)

        pottery = model.search("painted bowl", "alice", None, 10)

        assert ids(pottery)[0] == answer
        assert question in ids(pottery)

    def test_windows_never_cross_a_clear_or_replace_boundary(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        old = log.message("alice", "old secret")
        log.clear("alice")
        fresh = log.message("alice", "fresh start")
        log.replace("alice", message_count=1)
        replaced = log.message("alice", "replacement turn")
        model.apply(log.records)

        assert contexts(model, old, fresh, replaced) == ["", "", ""]
        assert ids(model.search("secret", "alice", None, 10)) == [old]

    def test_windows_are_kept_per_session_and_scope(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        a = log.message("alice", "alpha", session="s1")
        log.message("alice", "bravo", session="s2")
        log.message("alice", "charlie", session="s1", scope="other")
        b = log.message("alice", "delta", session="s1")
        model.apply(log.records)

        documents = docs_by_id(model)
        assert documents[a].context == "delta"
        assert documents[b].context == "alpha"

    def test_a_deleted_message_leaves_its_neighbours_windows_but_stays_searchable(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        first, doomed, third, fourth = log.messages("alice", "one", "two zebra", "three", "four")
        model.apply(log.records)
        log.delete("alice", doomed)
        model.apply(log.records[-1:])

        assert contexts(model, first, third, fourth, doomed) == [
            "three",
            "one\nfour",
            "one\nthree",
            "",
        ]
        assert ids(model.search("zebra", "alice", None, 10)) == [doomed]

    def test_deleting_another_owners_message_changes_nothing(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        _, target, _ = log.messages("alice", "one", "two", "three")
        log.delete("bob", target)
        model.apply(log.records[:3])
        before = docs_by_id(model)
        model.apply(log.records[3:])

        assert docs_by_id(model) == before

    def test_speaker_is_a_boosted_field_of_its_own(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        caroline = log.message("alice", "I adopted a puppy", speaker="Caroline", session="a")
        melanie = log.message("alice", "I adopted a puppy", speaker="Melanie", session="b")
        assistant = log.message("alice", "the weather is mild", role="assistant", session="c")
        model.apply(log.records)

        ranked = model.search("Caroline puppy", "alice", None, 10)

        assert ids(ranked) == [caroline, melanie]
        assert ids(model.search("melanie", "alice", None, 10)) == [melanie]
        assert ids(model.search("assistant", "alice", None, 10)) == [assistant]
        assert docs_by_id(model)[caroline].text == "I adopted a puppy"

    def test_speakers_are_the_owners_names_or_roles_and_follow_later_batches(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        log.message("alice", "hi", speaker="Caroline")
        melanie = log.message("alice", "hello", speaker="Melanie")
        log.message("alice", "how can I help?", role="assistant")
        log.message("bob", "hey", speaker="Zed")
        model.apply(log.records)
        assert model.speakers("alice") == ["Caroline", "Melanie", "assistant"]
        assert model.speakers("nobody") == []

        log.delete("alice", melanie)
        log.message("alice", "me too", speaker="Ava")
        model.apply(log.records[-2:])
        assert model.speakers("alice") == ["Ava", "Caroline", "assistant"]
        log.erase("alice")
        model.apply(log.records[-1:])
        assert (model.speakers("alice"), model.speakers("bob")) == ([], ["Zed"])

    def test_archived_and_superseded_nodes_leave_retrieval_until_restored(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        kept = log.message("alice", "favourite colour is green", session="a")
        archived = log.message("alice", "favourite colour is blue", session="b")
        superseded = log.message("alice", "favourite colour is red", session="c")
        log.archive("alice", archived)
        log.supersede("alice", superseded, by_node_id=kept)
        log.archive("bob", kept)
        model.apply(log.records)

        assert ids(model.search("colour", "alice", None, 10)) == [kept]
        everything = model.search("colour", "alice", None, 10, include_inactive=True)
        assert set(ids(everything)) == {kept, archived, superseded}
        assert docs_by_id(model)[superseded].state == "superseded"

        log.restore("alice", archived)
        model.apply(log.records[-1:])
        assert set(ids(model.search("colour", "alice", None, 10))) == {kept, archived}

    def test_owner_erased_removes_every_document_and_window(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        log.message("alice", "private diary entry")
        bob = log.message("bob", "private notes")
        log.erase("alice")
        after = log.message("alice", "a new beginning")
        model.apply(log.records[:2])
        model.apply(log.records[2:])

        assert ids(model.search("private", "alice", None, 10, include_inactive=True)) == []
        assert ids(model.search("private", "bob", None, 10)) == [bob]
        documents = docs_by_id(model)
        assert set(documents) == {bob, after}
        assert documents[after].context == ""

    def test_control_records_create_no_documents(self, model: LexicalModel, log: RecordLog) -> None:
        log.clear("alice")
        log.replace("alice", message_count=0)
        log.delete("alice", "nothing")
        log.archive("alice", "mem:nothing")
        model.apply(log.records)

        assert model.documents() == []
        assert model.applied_offset() == 3

    @pytest.mark.parametrize(
        "query",
        [
            "what's \"the plan",
            "owner:bob NOT plan",
            "plan AND (OR",
            "text:[plan TO",
            "*plan*~2^3",
            "+plan -the",
            "plan\\ \u00e9t\u00e9 \U0001f600",
        ],
    )
    def test_hostile_queries_are_searched_as_plain_words(
        self, model: LexicalModel, query: str, log: RecordLog
    ) -> None:
        plan = log.message("alice", "the plan for the summer")
        log.message("bob", "bob plan owner")
        model.apply(log.records)

        assert ids(model.search(query, "alice", None, 10)) == [plan]

    @pytest.mark.parametrize(
        ("stored", "query"),
        [
            ("Lunch at the Café Landtmann", "cafe"),
            ("We moved to München in May", "munchen"),
            ("the cafe on the corner", "café"),
            ("She lives on the Hauptstraße", "hauptstrasse"),
            ("my naïve résumé", "naive resume"),
            ("Wir fliegen nach İstanbul", "istanbul"),
            ("Wir fliegen nach İstanbul", "İstanbul"),
            ("We fly to Istanbul", "İstanbul"),
            ("Πήγαμε για καφές στην Αθήνα", "καφες αθηνα"),
            ("Новогодняя ёлка стоит в зале", "елка"),
            ("مَرْحَبًا بِكَ في البيت", "مرحبا"),
            ("مرحبـــا يا صديقي", "مرحبا"),
            ("שָׁלוֹם עֲלֵיכֶם", "שלום"),
            ("Достопримечательности Москвы", "достопримечательности"),
            ("Bir fincan καφές στην Αθήνα", "ΚΑΦΕΣ"),
            ("με τους φίλους μας", "φιλουσ"),
            ("Wir fliegen nach İstanbul", "i\u0307stanbul"),  # "İstanbul".lower()
        ],
    )
    def test_accents_are_folded_in_text_and_query(
        self, model: LexicalModel, log: RecordLog, stored: str, query: str
    ) -> None:
        found = log.message("alice", stored)
        log.message("alice", "nothing to see here", session="s2")
        model.apply(log.records)

        assert ids(model.search(query, "alice", None, 10)) == [found]

    @pytest.mark.parametrize(
        ("stored", "other", "query"),
        [
            ("我昨天在东京喝了咖啡", "我喜欢看书", "咖啡"),
            ("東京でコーヒーを飲みました", "本を読むのが好きです", "コーヒー"),
            ("서울에서 커피를 마셨다", "책 읽기를 좋아한다", "커피"),
            (unicodedata.normalize("NFD", "서울에서 커피를 마셨다"), "책 읽기를 좋아한다", "커피"),
            ("ｶﾌｪに行きました", "本を読むのが好きです", "カフェ"),
            ("新しいiPhone手机很好用", "我喜欢看书", "手机"),
            ("新しいiPhone手机很好用", "我喜欢看书", "iphone"),
            ("मुझे हिंदी पसंद है", "मुझे चाय पसंद है", "हिंदी"),
        ],
    )
    def test_a_word_inside_a_sentence_written_without_spaces_is_found(
        self, model: LexicalModel, log: RecordLog, stored: str, other: str, query: str
    ) -> None:
        found = log.message("alice", stored)
        log.message("alice", other, session="s2")
        model.apply(log.records)

        assert ids(model.search(query, "alice", None, 10)) == [found]

    def test_characters_in_the_querys_order_rank_first(
        self, model: LexicalModel, log: RecordLog
    ) -> None:
        scrambled = log.message("alice", "啡店的咖喱", session="s1")
        in_order = log.message("alice", "我们去咖啡店", session="s2")
        model.apply(log.records)

        hits = model.search("咖啡店在哪里", "alice", None, 10)

        assert ids(hits) == [in_order, scrambled]
        assert hits[0].score > hits[1].score

    @pytest.mark.parametrize("query", ["", "   ", "?!...", '"', "*", "()[]{}:^~"])
    def test_queries_without_words_return_nothing(
        self, model: LexicalModel, query: str, log: RecordLog
    ) -> None:
        log.message("alice", "anything at all")
        model.apply(log.records)

        assert model.search(query, "alice", None, 10) == []

    def test_the_same_records_in_any_batching_give_the_same_index(
        self, make_index: MakeIndex
    ) -> None:
        log = full_log()
        digests = []
        for name, sizes in [("one", [len(log.records)]), ("ones", [1]), ("mixed", [3, 17, 5, 40])]:
            with make_index(name) as model:
                start, turn = 0, 0
                while start < len(log.records):
                    size = sizes[turn % len(sizes)]
                    model.apply(log.records[start : start + size])
                    start, turn = start + size, turn + 1
                assert model.applied_offset() == len(log.records) - 1
                digests.append(model.digest())
        assert len(set(digests)) == 1

    def test_reapplying_records_is_harmless(self, model: LexicalModel) -> None:
        log = full_log()
        model.apply(log.records)
        digest = model.digest()

        model.apply(log.records)
        model.apply(log.records[10:30])

        assert model.digest() == digest
        assert model.applied_offset() == len(log.records) - 1

    def test_reopening_keeps_documents_and_offset(self, make_index: MakeIndex) -> None:
        log = full_log()
        with make_index("lex") as model:
            assert model.applied_offset() == -1
            model.apply(log.records[:50])
            digest, offset = model.digest(), model.applied_offset()
        with make_index("lex") as reopened:
            assert (reopened.digest(), reopened.applied_offset()) == (digest, offset)
            reopened.apply(log.records)
            assert reopened.applied_offset() == len(log.records) - 1
