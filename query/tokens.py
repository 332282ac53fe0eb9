"""Token counting for bundles, with the default model's WordPiece tokenizer."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from pathlib import Path

from tokenizers import Encoding, Tokenizer

_WORDS = re.compile(r"\w+|[^\w\s]", re.UNICODE)


UNKNOWN_BYTES_PER_TOKEN = 3
"""A piece of text the vocabulary does not know (``[UNK]``: a Thai word, an emoji, a run
of full-width letters, whatever its length) counts one token per this many UTF-8 bytes,
about one per character for the scripts it covers, instead of one in all."""

_CHUNKS = re.compile(r"[^ \t\n\r]+")
"""Runs between ASCII spaces, tabs and line breaks: no token spans one of those (below)."""

CACHED_CHUNKS = 200_000
"""Chunks whose counts a :class:`TokenCounter` keeps (forgotten all at once when full)."""

BATCH_FROM = 32
"""Texts counted in one batch call from this many on (fewer are counted one by one)."""

CACHED_COUNTS = 50_000
"""Texts whose counts :meth:`TokenCounter.count_many` remembers: a bundle's lines are its
memories, and the memories that answer come back request after request (counting was an
eighth of a retrieval's CPU)."""


class TokenCounter:
    """Counts tokens with ``tokenizer.json`` when given, else words and punctuation marks
    (an upper-bound stand-in that ``name`` reports as ``regex``)."""

    def __init__(self, tokenizer_file: Path | None = None, *, cached: int = CACHED_COUNTS) -> None:
        if cached < 0:
            raise ValueError("cached must be >= 0")
        self._cached = cached
        self._counts: OrderedDict[bytes, int] = OrderedDict()
        """Counts by a digest of the text: bounded memory, and no owner's text kept."""
        self._lock = threading.Lock()  # a sync wrapper's loop may count on another thread
        self._tokenizer: Tokenizer | None = None
        self._unknown: int | None = None
        if tokenizer_file is not None and tokenizer_file.exists():
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
            self._tokenizer.no_truncation()
            self._tokenizer.no_padding()
            self._unknown = self._tokenizer.token_to_id("[UNK]")
        self._chunked = self._tokenizer is not None and _splits_at_ascii_spaces(self._tokenizer)
        self._chunk_counts: dict[int, int] = {}
        """Counts by the hash of the chunk's UTF-8 bytes (a 64-bit SipHash with the process's
        own key)."""

    @property
    def name(self) -> str:
        return "wordpiece" if self._tokenizer is not None else "regex"

    def count(self, text: str) -> int:
        if self._tokenizer is None:
            return sum(_word_tokens(word) for word in _WORDS.findall(text))
        return self._counted(text, self._tokenizer.encode(text, add_special_tokens=False))

    def _counted(self, text: str, encoding: Encoding) -> int:
        return sum(
            _unknown_tokens(text[start:end]) if piece == self._unknown else 1
            for piece, (start, end) in zip(encoding.ids, encoding.offsets, strict=True)
        )

    def count_many(self, texts: list[str]) -> list[int]:
        """The counts of ``texts``; those counted lately are remembered (least recently
        used dropped first)."""
        digests = [hashlib.blake2b(t.encode(), digest_size=16).digest() for t in texts]
        with self._lock:
            counts = self._counts
            missing = {d: t for d, t in zip(digests, texts, strict=True) if d not in counts}
        if missing:  # counted outside the lock: another thread may count meanwhile
            fresh = self._count_new(list(missing.values()))
            found = dict(zip(missing, fresh, strict=True))
        else:
            found = {}
        with self._lock:
            counts.update(found)
            answer = []
            for digest, text in zip(digests, texts, strict=True):
                count = counts.get(digest)
                if count is None:  # dropped by another thread's eviction meanwhile
                    count = found[digest] if digest in found else self.count(text)
                    counts[digest] = count
                counts.move_to_end(digest)
                answer.append(count)
            while len(counts) > self._cached:
                counts.popitem(last=False)
            return answer

    def _count_new(self, texts: list[str]) -> list[int]:
        """The counts of ``texts``, exactly as :meth:`count` gives them.

        With a tokenizer that splits words at whitespace (BERT's), a text's count is the sum
        of its chunks' counts, and a chunk's count is remembered: a bundle's new memories
        mostly repeat words seen before, and tokenizing a whole text took ~80 µs."""
        if self._tokenizer is None:
            return [self.count(text) for text in texts]
        if not self._chunked:
            return self._tokenized(texts)
        # Keyed by the hash of the UTF-8 bytes: ``hash(str)`` hashes a string's internal
        # bytes, so "have" (1 byte a character) and "慨敶" (2) share a hash in every process.
        keyed = [
            [(hash(chunk.encode("utf-8", "surrogatepass")), chunk) for chunk in _CHUNKS.findall(t)]
            for t in texts
        ]
        known = self._chunk_counts
        new = {key: chunk for chunks in keyed for key, chunk in chunks if key not in known}
        fresh = dict(zip(new, self._tokenized(list(new.values())), strict=True))
        counts = [
            sum(fresh[key] if key in fresh else known[key] for key, _chunk in chunks)
            for chunks in keyed
        ]
        with self._lock:
            known = self._chunk_counts
            if len(known) + len(fresh) > CACHED_CHUNKS:
                # A new dict: a thread still reading the old one keeps its keys.
                self._chunk_counts = fresh if len(fresh) <= CACHED_CHUNKS else {}
            else:
                known.update(fresh)
        return counts

    def _tokenized(self, texts: list[str]) -> list[int]:
        """:meth:`count` of each text, tokenized one by one when they are few (a batch
        spreads over the tokenizer's threads: ten short chunks took the same time and ~60 %
        more CPU) and else in one batch."""
        tokenizer = self._tokenizer
        assert tokenizer is not None
        if len(texts) < BATCH_FROM:
            return [self.count(text) for text in texts]
        # No offsets are needed to count: the fast form skips them (~40 % less CPU).
        encodings = tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        counts = [len(e.ids) for e in encodings]
        unknown = [i for i, e in enumerate(encodings) if self._unknown in e.ids]
        if unknown:  # their offsets, in one more batch
            again = tokenizer.encode_batch([texts[i] for i in unknown], add_special_tokens=False)
            for i, encoding in zip(unknown, again, strict=True):
                counts[i] = self._counted(texts[i], encoding)
        return counts


def _splits_at_ascii_spaces(tokenizer: Tokenizer) -> bool:
    """Whether no token of ``tokenizer`` can span an ASCII space, tab or line break, so
    that a text's count is the sum of its ``_CHUNKS``' counts: BERT's normaliser (which
    keeps those characters as spaces, removes control characters and pads CJK characters
    with spaces) and pre-tokenizer (which splits at whitespace), and no added token with
    whitespace in it (added tokens are matched before both)."""
    config = json.loads(tokenizer.to_str())
    normalizer, pre_tokenizer = config.get("normalizer"), config.get("pre_tokenizer")
    return (
        (normalizer is None or normalizer.get("type") == "BertNormalizer")
        and pre_tokenizer is not None
        and pre_tokenizer.get("type") == "BertPreTokenizer"
        and not any(
            any(ch.isspace() for ch in token.content)
            for token in tokenizer.get_added_tokens_decoder().values()
        )
    )


def _unknown_tokens(piece: str) -> int:
    return max(1, -(-len(piece.encode("utf-8", "surrogatepass")) // UNKNOWN_BYTES_PER_TOKEN))


def _word_tokens(word: str) -> int:
    """A word of the stand-in count: one, or as an unknown piece when it is not ASCII (a
    run of Chinese or Thai is one ``\\w+`` match)."""
    return 1 if word.isascii() else _unknown_tokens(word)
