"""The lexical read model: one Tantivy index per shard, BM25 over context windows.

Each message node is indexed as a document with its own text (``text``), the text of its
neighbours in the same (owner, session, scope) (``context``, see :mod:`.lexical_windows`)
and its speaker (``speaker``). A query searches the three fields with boosts
(``text_boost``, ``context_boost`` and ``speaker_boost`` of :class:`LexicalSettings`); owner,
scope and state are zero-score filter clauses inside the Tantivy query, except where the
owner holds nearly the whole index (see :meth:`LexicalModel.search`).

Durability: the sidecar commits first, then the index commits the documents together with
a tracking document holding the batch's last offset. After a crash between the two the
sidecar is ahead; replaying from :meth:`LexicalModel.applied_offset` repairs the index
because every sidecar write is idempotent and documents are computed from its content.

A writer opened on an existing index (and one rolled back) hands its first operation the
opstamp of the last commit; see :func:`_open_writer` for why that operation must be one
that deletes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import re
import uuid
from pathlib import Path
from typing import Any, Final, Self

import msgspec
import tantivy
from tantivy import Occur, Query

from prme.projectors.model import Commit, ModelName, NodeState, ProjectedRecord
from prme.schemas import records
from prme.schemas.config import LexicalSettings
from prme.schemas.errors import PRMEError
from prme.schemas.records import (
    HistoryCleared,
    HistoryReplaced,
    Message,
    MessageDeleted,
    OwnerErased,
    memory_node_id,
)

from .lexical_terms import search_form, unspaced_pairs
from .lexical_windows import LexicalDocument, SequencePoint, WindowStore

MAX_QUERY_TERMS: Final = 256
WRITER_HEAP_BYTES: Final = 48_000_000
TRACKING_ID: Final = "__tracking__"
OPSTAMP_GUARD_ID: Final = "__opstamp_guard__"
"""A node id no document has: the target of the delete that takes a fresh writer's first
opstamp (see :func:`_open_writer`)."""
DEFAULT_SETTINGS: Final = LexicalSettings()

_DOCUMENT_FIELDS: Final = ("owner", "scope", "session_id", "state", "text", "context", "speaker")
_SEARCH_FIELDS: Final = ["text", "context", "speaker"]
_ID_HIGH: Final = "node_id_high"
_ID_LOW: Final = "node_id_low"
_NODE_PREFIX: Final = "mem:"
_U64: Final = (1 << 64) - 1
_TERM = re.compile(r"[^\W_]+")
WORDS_TOKENIZER: Final = "prme_words"
"""The search fields' tokenizer: Tantivy's simple tokenizer (words of letters and digits),
lower-cased, folded to ASCII (``café`` is ``cafe``, ``Straße`` is ``strasse``) and stemmed as
English (``booked`` is ``book``), over the text's ``search_form`` (each Chinese, Japanese or
Korean character a word of its own)."""
LEGACY_TOKENIZER: Final = "en_stem"
"""Tantivy's ``en_stem``: the search fields' tokenizer of an index built before 2026-12-07,
kept (with the text as it is) until ``prme rebuild --model lexical`` builds it again."""


MAX_WORD_BYTES: Final = 100
"""Longer words are left out of the index (a 21-letter Russian word is 42 bytes of UTF-8;
``en_stem`` leaves out words over 40)."""


def _analyzer(*, fold: bool, max_word_bytes: int) -> tantivy.TextAnalyzer:
    builder = (
        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
        .filter(tantivy.Filter.remove_long(max_word_bytes))
        .filter(tantivy.Filter.lowercase())
    )
    if fold:
        builder = builder.filter(tantivy.Filter.ascii_fold())
    return builder.filter(tantivy.Filter.stemmer("english")).build()


_ANALYZERS: Final[dict[str, tantivy.TextAnalyzer]] = {
    WORDS_TOKENIZER: _analyzer(fold=True, max_word_bytes=MAX_WORD_BYTES),
    # What Tantivy registers as ``en_stem``, so a query applies it as the index did.
    LEGACY_TOKENIZER: _analyzer(fold=False, max_word_bytes=40),
}
_WORDS: Final = (
    tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
    .filter(tantivy.Filter.lowercase())
    .build()
)
"""A query's words as the index splits them, before folding and stemming."""
_log = logging.getLogger(__name__)
_STATES: Final[dict[type, NodeState]] = {
    records.NodeArchived: "archived",
    records.NodeRestored: "active",
    records.NodeSuperseded: "superseded",
}


class LexicalHit(msgspec.Struct, frozen=True):
    node_id: str
    score: float


def _schema() -> tantivy.Schema:
    builder = _document_fields()
    # A memory node id (``mem:<uuid>``) as two signed 64-bit fast fields: a search reads a
    # hit's id from these columns instead of decompressing its stored document.
    builder.add_integer_field(_ID_HIGH, fast=True)
    builder.add_integer_field(_ID_LOW, fast=True)
    return builder.build()


def _document_fields() -> tantivy.SchemaBuilder:
    """A schema builder holding the document fields (every field but the id columns)."""
    builder = tantivy.SchemaBuilder()
    for name in ("node_id", "owner", "scope", "session_id", "state"):
        builder.add_text_field(name, stored=True, tokenizer_name="raw", index_option="basic")
    for name, positions in (("text", "position"), ("context", "freq"), ("speaker", "freq")):
        builder.add_text_field(
            name, stored=True, tokenizer_name=WORDS_TOKENIZER, index_option=positions
        )
    builder.add_integer_field("offset", stored=True, indexed=True)
    return builder


def document_fields(document: LexicalDocument, *, fast_ids: bool = True) -> dict[str, Any]:
    """The index fields of ``document``: every field of it and, with ``fast_ids``, the id
    columns."""
    ids = _id_columns(document.node_id) if fast_ids else {}
    return {**ids, **msgspec.structs.asdict(document)}


def _id_columns(node_id: str) -> dict[str, int]:
    """The fast-field values of ``node_id``; ``{}`` unless it is ``mem:`` and a canonical
    UUID (any other id is read from the stored document)."""
    if not node_id.startswith(_NODE_PREFIX):
        return {}
    text = node_id.removeprefix(_NODE_PREFIX)
    try:
        value = uuid.UUID(text)
    except ValueError:
        return {}
    if str(value) != text:
        return {}
    high, low = divmod(value.int, 1 << 64)
    return {_ID_HIGH: _signed(high), _ID_LOW: _signed(low)}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _node_id_of(high: object, low: object) -> str | None:
    """``mem:<uuid>`` from its two signed halves, formatted as ``str(uuid.UUID)`` does
    (without building one: a search formats up to ``limit`` of them)."""
    if not isinstance(high, int) or not isinstance(low, int):
        return None
    h = "%032x" % ((high & _U64) << 64 | low & _U64)  # one format: ~30 % less than two
    return f"{_NODE_PREFIX}{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _filter_clause(schema: tantivy.Schema, field: str, value: str) -> tantivy.Query:
    return Query.const_score_query(Query.term_query(schema, field, value), 0.0)


def _address_key(address: tantivy.DocAddress) -> tuple[int, int]:
    return (address.segment_ord, address.doc)


def _excluded(
    searcher: tantivy.Searcher,
    schema: tantivy.Schema,
    owner: str,
    include_inactive: bool,
    limit: int,
) -> set[tuple[int, int]] | None:
    """Every document of ``searcher`` that the owner and state filters would drop, when
    there are at most ``limit`` of them (an owner alone, or nearly, in its partition);
    else ``None``.

    With them in hand a search runs without filter clauses (which keep Tantivy from pruning
    with block-max WAND), asks for ``limit`` more hits and drops these: the hits left are
    exactly the filtered search's, in the same order, since the filters add no score.
    Every document with text has exactly one owner and one state term, so the documents of
    the other owners' and states' terms are all that fail; term counts include deleted
    documents, so their sum bounds the set from above."""
    if searcher.doc_freq("owner", owner) * 2 < searcher.num_docs:
        return None
    others = [
        ("owner", term, count)
        for term, count in searcher.terms_with_prefix("owner", "")
        if term != owner
    ]
    if not include_inactive:
        others.extend(
            ("state", term, count)
            for term, count in searcher.terms_with_prefix("state", "")
            if term != "active"
        )
    bound = sum(count for _field, _term, count in others)
    if bound > limit:
        return None
    if bound == 0:
        return set()
    clauses = [(Occur.Should, _filter_clause(schema, field, term)) for field, term, _ in others]
    hits = searcher.search(Query.boolean_query(clauses), bound, count=False).hits
    return {_address_key(address) for _score, address in hits}


class _OpenedIndex(msgspec.Struct, frozen=True):
    index: tantivy.Index
    fast_ids: bool
    """Whether it has the id fast fields."""
    tokenizer: str
    """Its search fields' tokenizer, a key of ``_ANALYZERS``."""


def _open_index(schema: tantivy.Schema, index_dir: Path) -> _OpenedIndex:
    """The index in ``index_dir``. One built before the id fast fields or before
    ``WORDS_TOKENIZER`` keeps its schema until ``prme rebuild --model lexical``."""
    try:
        index = tantivy.Index(schema, path=str(index_dir), reuse=True)
    except ValueError as error:
        if "schema does not match" not in str(error):
            raise
        index = tantivy.Index.open(str(index_dir))
    index.register_tokenizer(WORDS_TOKENIZER, _ANALYZERS[WORDS_TOKENIZER])
    tokenizer = _text_tokenizer(index_dir)
    try:
        index.searcher().fast_field_values(_ID_HIGH, [])
    except ValueError:
        return _OpenedIndex(index, False, tokenizer)
    return _OpenedIndex(index, True, tokenizer)


def _text_tokenizer(index_dir: Path) -> str:
    """The tokenizer of the index's ``text`` field, as its ``meta.json`` names it."""
    meta = msgspec.json.decode((index_dir / "meta.json").read_bytes())
    for field in meta["schema"]:
        if field["name"] == "text":
            name = field["options"]["indexing"]["tokenizer"]
            if name not in _ANALYZERS:
                raise PRMEError(
                    f"the lexical index in {index_dir} uses an unknown tokenizer {name!r}"
                )
            return str(name)
    raise PRMEError(f"the lexical index in {index_dir} has no text field")


def create_index(path: Path) -> tantivy.Index:
    """A new, empty index of the current schema in ``path`` (the rebuild floor's)."""
    return _open_index(_schema(), path).index


def _take_commit_opstamp(writer: tantivy.IndexWriter) -> None:
    """Spend ``writer``'s first opstamp on a delete that matches no document.

    Tantivy starts a new writer's opstamps at the last commit's own opstamp ``C`` (and so does
    ``rollback``), so the first operation after a restart is stamped ``C``, as if it were
    part of that commit. A merge of committed segments that starts before the writer's
    first commit has target ``C``: it applies the operations stamped <= ``C`` to a segment
    whose deletes are older, skips a segment whose deletes are stamped ``C`` ("up to date"),
    and hands the merged segment the first segment's delete cursor, which has passed the
    operation. A delete in that operation is then never applied to the second segment's
    documents: after a projector was killed between a commit and the merge it started, the
    first delete of the replayed batch was lost and a stale version of that node stayed in
    the index next to the new one. A delete of a node id that no document has makes that
    operation harmless."""
    writer.delete_documents_by_term("node_id", OPSTAMP_GUARD_ID)


def _open_writer(index: tantivy.Index) -> tantivy.IndexWriter:
    writer = index.writer(heap_size=WRITER_HEAP_BYTES, num_threads=1)
    _take_commit_opstamp(writer)
    return writer


class LexicalModel:
    """The lexical read model of one shard, in ``path`` (index and sidecar)."""

    name: ModelName = "lexical"

    def __init__(self, path: Path, settings: LexicalSettings = DEFAULT_SETTINGS) -> None:
        self._settings = settings
        index_dir = path / "index"
        index_dir.mkdir(parents=True, exist_ok=True)
        opened = _open_index(_schema(), index_dir)
        self._index, self._fast_ids = opened.index, opened.fast_ids
        self._analyzer = _ANALYZERS[opened.tokenizer]
        self._legacy_terms = opened.tokenizer == LEGACY_TOKENIZER
        if self._legacy_terms:
            _log.warning(
                "the lexical index in %s folds no accents and keeps runs of Chinese, Japanese "
                "or Korean as one word; `prme rebuild --model lexical` builds it again",
                index_dir,
            )
        self._schema = self._index.schema
        self._writer: tantivy.IndexWriter | None = _open_writer(self._index)
        # A process killed mid-commit leaves files no meta.json names (such as the .del file
        # of an uncommitted delete); replaying the same batch would collide with them.
        self._writer.garbage_collect_files()
        self._windows = WindowStore(
            path / "windows.sqlite3",
            window_before=settings.window_before,
            window_after=settings.window_after,
        )
        self._boosts = {
            "text": settings.text_boost,
            "context": settings.context_boost,
            "speaker": settings.speaker_boost,
        }
        self._offset = self._stored_offset()
        self._speakers: dict[str, list[str]] = {}

    @property
    def legacy_terms(self) -> bool:
        """Whether the index has the terms of before 2026-12-07 (``LEGACY_TOKENIZER``)."""
        return self._legacy_terms

    def _stored_offset(self) -> int:
        searcher = self._index.searcher()
        hits = searcher.search(Query.term_query(self._schema, "node_id", TRACKING_ID), 1).hits
        if not hits:
            return -1
        return int(searcher.doc(hits[0][1])["offset"][0])

    def applied_offset(self) -> int:
        return self._offset

    def apply(self, batch: list[ProjectedRecord]) -> None:
        """Apply the records past :meth:`applied_offset`, then commit them with the offset."""
        commit = self.stage(batch)
        if commit is not None:
            commit()

    def stage(self, batch: list[ProjectedRecord]) -> Commit | None:
        """Write the records past :meth:`applied_offset` to the sidecar (committed) and to
        the index writer (not committed); the returned step commits the index with the
        offset (see ``StagedCommits``)."""
        items = [item for item in batch if item.offset > self._offset]
        if not items:
            return None
        writer = self._require_writer()
        try:
            changed, points, erased, fresh = self._update_windows(items)
            documents = sorted(self._windows.documents_for(changed, points).items())
            self._windows.commit()
        except BaseException:
            self._windows.rollback()
            raise
        last = max(item.offset for item in items)
        try:
            for owner in erased:
                writer.delete_documents_by_term("owner", owner)
            for node_id, document in documents:
                # The index is never ahead of the sidecar: a new row has no document yet.
                if node_id not in fresh:
                    writer.delete_documents_by_term("node_id", node_id)
                if document is not None:
                    writer.add_document(self._document(document))
            writer.delete_documents_by_term("node_id", TRACKING_ID)
            writer.add_document(tantivy.Document(node_id=TRACKING_ID, offset=last))
        except BaseException:
            self._roll_back(writer)
            raise

        def commit() -> None:
            try:
                writer.commit()
            except BaseException:
                self._roll_back(writer)
                raise
            self._index.reload()
            self._offset = last
            self._speakers.clear()

        return commit

    @staticmethod
    def _roll_back(writer: tantivy.IndexWriter) -> None:
        writer.rollback()  # a new writer inside, stamping from the last commit again
        _take_commit_opstamp(writer)

    def _update_windows(
        self, items: list[ProjectedRecord]
    ) -> tuple[set[str], list[SequencePoint], list[str], set[str]]:
        """Apply the records to the sidecar; returns the nodes changed, the sequence points
        changed, the owners erased and the nodes whose rows this batch created."""
        changed: set[str] = set()
        fresh: set[str] = set()
        points: list[SequencePoint] = []
        erased: list[str] = []
        windows = self._windows
        for item in items:
            record = item.record
            if isinstance(record, Message):
                if item.node is not None:
                    point, created = windows.add_message(item.offset, item.node)
                    points.append(point)
                    changed.add(item.node.node_id)
                    if created:
                        fresh.add(item.node.node_id)
            elif isinstance(record, HistoryCleared | HistoryReplaced):
                points.append(
                    windows.add_boundary(record.owner, record.session_id, record.scope, item.offset)
                )
            elif isinstance(record, MessageDeleted):
                node_id = memory_node_id(record.target_event_id)
                removed = windows.remove_message(record.owner, node_id)
                if removed is not None:
                    points.append(removed)
                    changed.add(node_id)
            elif isinstance(
                record, records.NodeArchived | records.NodeRestored | records.NodeSuperseded
            ):
                if windows.set_state(record.owner, record.node_id, _STATES[type(record)]):
                    changed.add(record.node_id)
            elif isinstance(record, OwnerErased):
                windows.erase_owner(record.owner)
                erased.append(record.owner)
        return changed, points, erased, fresh

    def _document(self, document: LexicalDocument) -> tantivy.Document:
        if not self._legacy_terms:
            document = msgspec.structs.replace(
                document,
                text=search_form(document.text),
                context=search_form(document.context),
                speaker=search_form(document.speaker),
            )
        return tantivy.Document(**document_fields(document, fast_ids=self._fast_ids))

    def search(
        self,
        query: str,
        owner: str,
        scope: str | None,
        limit: int,
        include_inactive: bool = False,
    ) -> list[LexicalHit]:
        """BM25 hits for the owner's nodes (best first); ``[]`` for a query without words.

        Query syntax is not interpreted: the words are searched as a disjunction, so text
        such as ``what's "the plan`` or ``owner:bob NOT x`` is just words.
        """
        self._require_writer()  # a closed model answers nothing, like the other stores
        text_query = (
            self._legacy_text_query(query) if self._legacy_terms else self._text_query(query)
        )
        if text_query is None or limit <= 0:
            return []
        searcher = self._index.searcher()
        excluded = (
            _excluded(searcher, self._schema, owner, include_inactive, limit)
            if scope is None
            else None
        )
        if excluded is None:
            hits = self._filtered_hits(searcher, text_query, owner, scope, include_inactive, limit)
        else:
            found = searcher.search(text_query, limit + len(excluded), count=False).hits
            hits = [hit for hit in found if _address_key(hit[1]) not in excluded][:limit]
        addresses = [address for _score, address in hits]
        if self._fast_ids and addresses:
            highs = searcher.fast_field_values(_ID_HIGH, addresses)
            lows = searcher.fast_field_values(_ID_LOW, addresses)
        else:
            highs = lows = [None] * len(addresses)
        return [
            LexicalHit(
                node_id=_node_id_of(high, low) or searcher.doc(address)["node_id"][0],
                score=float(score),
            )
            for (score, address), high, low in zip(hits, highs, lows, strict=True)
        ]

    def _text_query(self, query: str) -> tantivy.Query | None:
        """The query's words as one flat disjunction of (field, term) clauses, each word
        once, and each pair of neighbouring unspaced characters as a phrase on ``text``;
        ``None`` without words.

        Scores equal the query parser's (which nests a disjunction over the fields inside
        one per word, and drops a repeated word but not two words of one stem) up to float
        rounding, and a flat union of term queries is what Tantivy's block-max WAND prunes:
        a query of common words over 100k documents stops scoring most of them."""
        form = search_form(query)
        words = list(dict.fromkeys(_WORDS.analyze(form)))[:MAX_QUERY_TERMS]
        clauses: list[tuple[Occur, tantivy.Query]] = []
        for word in words:
            for token in self._analyzer.analyze(word):
                self._add_term(clauses, token)
        if not clauses:
            return None
        for pair in unspaced_pairs(query, MAX_QUERY_TERMS):
            phrase = Query.phrase_query(self._schema, "text", list(pair))
            self._add_clause(clauses, "text", phrase)
        return Query.boolean_query(clauses)

    def _legacy_text_query(self, query: str) -> tantivy.Query | None:
        """``_text_query`` for an index of ``LEGACY_TOKENIZER``: words as Python's ``\\w``
        splits them, and a word the analyser splits keeps the parser's query (a phrase of
        the whole word)."""
        terms = _TERM.findall(query.lower())[:MAX_QUERY_TERMS]
        if not terms:
            return None
        clauses: list[tuple[Occur, tantivy.Query]] = []
        seen: set[str] = set()
        for word in terms:
            tokens = self._analyzer.analyze(word)
            if len(tokens) > 1:
                parsed, _errors = self._index.parse_query_lenient(
                    " ".join(terms), default_field_names=_SEARCH_FIELDS, field_boosts=self._boosts
                )
                return parsed
            if word in seen:
                continue
            seen.add(word)
            for token in tokens:
                self._add_term(clauses, token)
        return Query.boolean_query(clauses)

    def _add_term(self, clauses: list[tuple[Occur, tantivy.Query]], token: str) -> None:
        for field in _SEARCH_FIELDS:
            self._add_clause(clauses, field, Query.term_query(self._schema, field, token))

    def _add_clause(
        self, clauses: list[tuple[Occur, tantivy.Query]], field: str, query: tantivy.Query
    ) -> None:
        boost = self._boosts[field]
        clauses.append((Occur.Should, query if boost == 1.0 else Query.boost_query(query, boost)))

    def _filtered_hits(
        self,
        searcher: tantivy.Searcher,
        text_query: tantivy.Query,
        owner: str,
        scope: str | None,
        include_inactive: bool,
        limit: int,
    ) -> list[tuple[float, tantivy.DocAddress]]:
        """The best ``limit`` hits of ``text_query`` with owner, scope and state as
        zero-score filter clauses."""
        filters = [("owner", owner)]
        if scope is not None:
            filters.append(("scope", scope))
        if not include_inactive:
            filters.append(("state", "active"))
        clauses = [(Occur.Must, text_query)]
        clauses.extend((Occur.Must, _filter_clause(self._schema, f, v)) for f, v in filters)
        return list(searcher.search(Query.boolean_query(clauses), limit, count=False).hits)

    def speakers(self, owner: str) -> list[str]:
        """The owner's speakers (a message without a name counts its role), sorted; read
        from the sidecar once per owner between batches."""
        known = self._speakers.get(owner)
        if known is None:
            known = self._speakers[owner] = self._windows.speakers(owner)
        return list(known)

    def documents(self) -> list[LexicalDocument]:
        """Every indexed document, sorted by node id (for digests and inspection)."""
        searcher = self._index.searcher()
        total = searcher.num_docs
        if total == 0:
            return []
        found: list[LexicalDocument] = []
        for _score, address in searcher.search(Query.all_query(), total, count=False).hits:
            stored = searcher.doc(address).to_dict()
            node_id = stored["node_id"][0]
            if node_id == TRACKING_ID:
                continue
            values = {name: stored.get(name, [""])[0] for name in _DOCUMENT_FIELDS}
            found.append(LexicalDocument(node_id=node_id, **values))
        found.sort(key=lambda document: document.node_id)
        return found

    def digest(self) -> str:
        """A hash of the offset and of every document's content, whatever the segment layout:
        rows are sorted on all their fields, so which segment holds which document does not
        matter, while a second (stale) version of a node still changes the hash."""
        rows = sorted(
            [d.node_id, d.owner, d.scope, d.session_id, d.state, d.text, d.context, d.speaker]
            for d in self.documents()
        )
        return hashlib.sha256(msgspec.json.encode([self._offset, rows])).hexdigest()

    def purge(self) -> None:
        """After an erasure: rewrite the index from its live documents in one commit and
        delete the old segment files, so deleted documents (whose text Tantivy keeps in its
        segments until a merge) leave the disk; then truncate the sidecar's WAL. Costs a
        re-index of the partition's documents."""
        writer = self._require_writer()
        documents = self.documents()
        try:
            writer.delete_all_documents()
            for document in documents:
                writer.add_document(self._document(document))
            writer.add_document(tantivy.Document(node_id=TRACKING_ID, offset=self._offset))
            writer.commit()
        except BaseException:
            writer.rollback()
            raise
        self._index.reload()
        writer.garbage_collect_files()
        self._windows.checkpoint()

    def _require_writer(self) -> tantivy.IndexWriter:
        if self._writer is None:
            raise PRMEError("the lexical model is closed")
        return self._writer

    def close(self) -> None:
        """Release the index writer (its lock) and the sidecar; safe to call twice."""
        if self._writer is None:
            return
        writer, self._writer = self._writer, None
        writer.wait_merging_threads()
        self._windows.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
