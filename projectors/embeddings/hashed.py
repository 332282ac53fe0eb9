"""Deterministic, model-free embedding providers for tests and benchmarks.

``HashedBagOfWordsProvider`` maps each lower-cased word to a signed slot by hashing it and
L2-normalizes the counts: texts sharing words get similar vectors, and nothing is loaded.
It is not a semantic model; never use it for real retrieval.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import numpy as np

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
        rows: list[list[float]] = self.matrix(check_texts(texts)).tolist()
        return rows

    async def embed_array(self, texts: Sequence[str]) -> np.ndarray:
        """The vectors ``embed`` gives, as one float64 array."""
        return self.matrix(check_texts(texts))

    def vector(self, text: str) -> list[float]:
        """The vector of one text (an empty text maps to the first unit vector)."""
        row: list[float] = self.matrix([text])[0].tolist()
        return row

    def matrix(self, texts: list[str]) -> np.ndarray:
        """One row per text: each word adds its sign at its slot, and the row is divided by
        its L2 norm. The counts, their squares and the squares' sum are small integers, so
        they are exact in float64 whatever the order of summation."""
        dimension = self._dimension
        cells: list[int] = []
        signs: list[float] = []
        for row, text in enumerate(texts):
            base = row * dimension
            for word in _WORD.findall(text.lower()):
                slot, sign = self._slots.get(word) or self._slot(word)
                cells.append(base + slot)
                signs.append(sign)
        flat = np.bincount(
            np.array(cells, dtype=np.intp),
            weights=np.array(signs, dtype=np.float64),
            minlength=len(texts) * dimension,
        )
        counts = flat.astype(np.float64, copy=False).reshape(len(texts), dimension)
        norms = np.sqrt(np.einsum("ij,ij->i", counts, counts))
        empty = norms == 0.0
        counts[empty, 0] = 1.0
        norms[empty] = 1.0
        counts /= norms[:, None]
        return counts

    def _slot(self, word: str) -> tuple[int, float]:
        """A word's slot and sign: the first bytes of its blake2b digest."""
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        hit = (
            int.from_bytes(digest[:4], "little") % self._dimension,
            1.0 if digest[4] & 1 else -1.0,
        )
        if len(self._slots) < _MAX_CACHED_WORDS:
            self._slots[word] = hit
        return hit


class HashedBagOfWordsQueryProvider(HashedBagOfWordsProvider):
    """The same documents, plus a distinct query recipe (a ``query:`` word is added), to
    exercise the query/document split."""

    @property
    def model_version(self) -> str:
        return super().model_version + ":query-prefix-v1"

    async def embed_query(self, text: str) -> list[float]:
        return self.vector("query: " + text)
