"""Deterministic, model-free embedding providers for tests and benchmarks.

``HashedBagOfWordsProvider`` maps each lower-cased word to a signed slot by hashing it and
L2-normalizes the counts: texts sharing words get similar vectors, and nothing is loaded.
It is not a semantic model; never use it for real retrieval.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence

from .validation import check_texts

_WORD = re.compile(r"\w+")
_MAX_CACHED_WORDS = 200_000


class HashedBagOfWordsProvider:
    """Hashed bag-of-words vectors (no ``embed_query``: queries use the document recipe)."""

    def __init__(
        self, dimension: int = 64, *, model_name: str = "prme/hashed-bag-of-words"
    ) -> None:
        if isinstance(dimension, bool) or not isinstance(dimension, int) or dimension < 2:
            raise ValueError(f"dimension must be an int >= 2, got {dimension!r}")
        self._dimension = dimension
        self._model_name = model_name
        self._slots: dict[str, tuple[int, float]] = {}
        """word -> (slot, sign): the hash of a word is the same every time."""

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def model_version(self) -> str:
        return "blake2b-signed-counts:lower:l2:v1"

    @property
    def dimension(self) -> int:
        return self._dimension

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [self.vector(text) for text in check_texts(texts)]

    def vector(self, text: str) -> list[float]:
        """The vector of one text (an empty text maps to the first unit vector)."""
        values = [0.0] * self._dimension
        slots = self._slots
        touched: set[int] = set()
        for word in _WORD.findall(text.lower()):
            hit = slots.get(word)
            if hit is None:
                digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
                slot = int.from_bytes(digest[:4], "little") % self._dimension
                hit = (slot, 1.0 if digest[4] & 1 else -1.0)
                if len(slots) < _MAX_CACHED_WORDS:
                    slots[word] = hit
            values[hit[0]] += hit[1]
            touched.add(hit[0])
        # Only touched slots can be non-zero, and adding 0.0 changes no sum, so summing
        # them in slot order gives the full sum bit for bit; untouched slots stay 0.0.
        order = sorted(touched)
        norm = math.sqrt(sum(values[slot] * values[slot] for slot in order))
        if norm == 0.0:
            values[0] = 1.0
            return values
        for slot in order:
            values[slot] /= norm
        return values


class HashedBagOfWordsQueryProvider(HashedBagOfWordsProvider):
    """The same documents, plus a distinct query recipe (a ``query:`` word is added), to
    exercise the query/document split."""

    @property
    def model_version(self) -> str:
        return super().model_version + ":query-prefix-v1"

    async def embed_query(self, text: str) -> list[float]:
        return self.vector("query: " + text)
