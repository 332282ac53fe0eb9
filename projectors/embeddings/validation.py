"""Boundary checks on what an embedding provider reports and returns.

Every path that admits vectors (uncached encoding, the caches, the vector stores) runs
these checks, so a malformed response is rejected whole before anything is stored.
"""

from __future__ import annotations

import array
import itertools
import numbers
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from prme.schemas.errors import InvalidEmbedding

from .protocol import EmbeddingIdentity

FLOAT32_MAX = float(np.finfo(np.float32).max)
_PLAIN_NUMBERS = frozenset((float, int))

Float32Vector = array.array
"""A vector as float32 (typecode ``"f"``): what the vector cache holds, handed on to the
stores without a list of Python floats in between."""


def float32_vector(data: bytes | memoryview) -> Float32Vector:
    """A vector from its little-endian float32 bytes (as the cache and changelog keep it)."""
    vector = array.array("f", data)
    if sys.byteorder != "little":
        vector.byteswap()
    return vector


def float32_vectors(matrix: np.ndarray) -> list[Float32Vector]:
    """The rows of a float32 matrix as vectors."""
    return [array.array("f", row.tobytes()) for row in matrix.astype(np.float32, copy=False)]


def identity_of(provider: Any) -> EmbeddingIdentity:
    """The provider's identity (or the identity itself), checked: ``model_name`` and
    ``model_version`` non-empty ``str``, ``dimension`` a positive ``int``."""
    if isinstance(provider, EmbeddingIdentity):
        model_name, model_version, dimension = (
            provider.model_name,
            provider.model_version,
            provider.dimension,
        )
    else:
        try:
            model_name = provider.model_name
            model_version = provider.model_version
            dimension = provider.dimension
        except AttributeError as error:
            raise InvalidEmbedding(
                f"embedding provider {type(provider).__name__} lacks {error.name!r}: a provider "
                "needs model_name, model_version and dimension"
            ) from error
    for field, value in (("model_name", model_name), ("model_version", model_version)):
        if not isinstance(value, str) or not value.strip():
            raise InvalidEmbedding(
                f"embedding provider {field} must be a non-empty str, got {value!r}"
            )
    if isinstance(dimension, bool) or not isinstance(dimension, int) or dimension <= 0:
        raise InvalidEmbedding(
            f"embedding provider dimension must be a positive int, got {dimension!r}"
        )
    return EmbeddingIdentity(model_name, model_version, int(dimension))


def check_identity_unchanged(expected: EmbeddingIdentity, provider: Any) -> None:
    """Raise when the provider no longer reports ``expected`` (metadata must stay stable
    for a provider's lifetime: switching models needs a new provider and cache)."""
    current = identity_of(provider)
    if current != expected:
        raise InvalidEmbedding(
            f"embedding provider identity changed mid-life from {expected.key!r} to "
            f"{current.key!r}; create a new provider (and cache) to switch models"
        )


def check_texts(texts: Sequence[str]) -> list[str]:
    """``texts`` as a list, each checked to be a ``str`` (a bare ``str`` is rejected)."""
    if isinstance(texts, str):
        raise TypeError("embed() takes a sequence of texts, not a single str")
    batch = list(texts)
    for index, text in enumerate(batch):
        if not isinstance(text, str):
            raise TypeError(f"text {index} is {type(text).__name__}, not str")
    return batch


def validate_vectors(
    identity_or_provider: Any, texts_count: int, vectors: Any
) -> list[list[float]]:
    """Check a complete ``embed`` response and return it as fresh ``float`` lists.

    Exactly ``texts_count`` vectors, each a list or tuple of real numbers (``bool`` and
    numeric strings are rejected) of the declared dimension, finite and within float32
    range. Raises ``InvalidEmbedding`` (a ``ValueError``) naming the offending index.
    """
    matrix = validate_matrix(identity_or_provider, texts_count, vectors)
    rows: list[list[float]] = matrix.tolist()
    return rows


def checked_vectors(
    identity_or_provider: Any, vectors: list[Any]
) -> list[list[float]] | list[Float32Vector]:
    """``validate_vectors(identity, len(vectors), vectors)`` for a caller that only reads
    the result: when every vector is a :data:`Float32Vector` (what the embedding path hands
    on) or a ``list`` of ``float``, the vectors themselves once checked, saving the copy;
    otherwise the fresh lists."""
    dimension = identity_of(identity_or_provider).dimension
    if not isinstance(vectors, list):
        return validate_vectors(identity_or_provider, len(vectors), vectors)
    if all(_is_float32(v) and len(v) == dimension for v in vectors):
        if _in_float32(np.frombuffer(b"".join(vectors), dtype=np.float32)):
            return vectors
    elif (
        all(type(v) is list and len(v) == dimension for v in vectors)
        and set(map(type, itertools.chain.from_iterable(vectors))) <= {float}
        and _in_float32(np.array(vectors, dtype=np.float64))
    ):
        return vectors
    plain = [v.tolist() if _is_float32(v) else v for v in vectors]
    return validate_vectors(identity_or_provider, len(plain), plain)


def _is_float32(vector: Any) -> bool:
    return type(vector) is array.array and vector.typecode == "f"


def _in_float32(matrix: np.ndarray) -> bool:
    """Every component finite and within float32 range."""
    return not (~np.isfinite(matrix) | (np.abs(matrix) > FLOAT32_MAX)).any()


def validate_matrix(identity_or_provider: Any, texts_count: int, vectors: Any) -> np.ndarray:
    """``validate_vectors`` as one ``(texts_count, dimension)`` float64 array: the whole
    response is checked in a few array operations; only a response that fails them is
    checked vector by vector, to name the offending index."""
    identity = identity_of(identity_or_provider)
    if isinstance(texts_count, bool) or not isinstance(texts_count, int) or texts_count < 0:
        raise TypeError(f"texts_count must be a non-negative int, got {texts_count!r}")
    if not isinstance(vectors, (list, tuple)):
        raise InvalidEmbedding(
            f"embedding provider must return a list of vectors, got {type(vectors).__name__}"
            " (convert arrays with .tolist())"
        )
    if len(vectors) != texts_count:
        raise InvalidEmbedding(
            f"embedding provider returned {len(vectors)} vectors for {texts_count} inputs; "
            "expected exactly one per input"
        )
    dimension = identity.dimension
    matrix = _checked_matrix(dimension, vectors)
    if matrix is None:
        rows = [_checked_vector(dimension, index, vector) for index, vector in enumerate(vectors)]
        matrix = np.array(rows, dtype=np.float64).reshape(len(rows), dimension)
    return matrix


def _checked_matrix(dimension: int, vectors: list[Any] | tuple[Any, ...]) -> np.ndarray | None:
    """The vectors as one array when every check passes; ``None`` when any fails."""
    if not all(isinstance(v, (list, tuple)) and len(v) == dimension for v in vectors):
        return None
    if not set(map(type, itertools.chain.from_iterable(vectors))) <= _PLAIN_NUMBERS:
        return None
    try:
        matrix = np.array(vectors, dtype=np.float64).reshape(len(vectors), dimension)
    except OverflowError:
        return None
    return matrix if _in_float32(matrix) else None


def validate_array(identity_or_provider: Any, texts_count: int, matrix: Any) -> np.ndarray:
    """Check an ``embed_array`` response: one ``(texts_count, dimension)`` array of a float
    dtype, every component finite and within float32 range. Returns a float32 copy (what
    the stores keep; a float64 array is rounded as ``validate_matrix``'s rows are), so the
    provider may reuse its buffer."""
    identity = identity_of(identity_or_provider)
    if isinstance(matrix, np.ma.MaskedArray):  # its checks skip what the mask hides
        raise InvalidEmbedding(
            "embedding provider's embed_array must return a plain float array, not a masked one"
        )
    if not isinstance(matrix, np.ndarray) or matrix.ndim != 2:
        shape = f"a {matrix.ndim}-D array" if isinstance(matrix, np.ndarray) else None
        raise InvalidEmbedding(
            "embedding provider's embed_array must return a 2-D float array, got "
            f"{shape or type(matrix).__name__}"
        )
    if not np.issubdtype(matrix.dtype, np.floating):
        raise InvalidEmbedding(
            f"embedding provider's embed_array must return a float array, got {matrix.dtype}"
        )
    if matrix.shape[0] != texts_count:
        raise InvalidEmbedding(
            f"embedding provider returned {matrix.shape[0]} vectors for {texts_count} inputs; "
            "expected exactly one per input"
        )
    if matrix.shape[1] != identity.dimension:
        raise InvalidEmbedding(
            f"vector 0: has {matrix.shape[1]} components, the provider declares dimension "
            f"{identity.dimension}"
        )
    bad = ~np.isfinite(matrix)
    if matrix.dtype.itemsize > np.dtype(np.float32).itemsize:
        bad |= np.abs(matrix) > FLOAT32_MAX
    if bad.any():
        index, position = (int(i) for i in np.argwhere(bad)[0])
        raise InvalidEmbedding(
            f"vector {index}: component {position} is {float(matrix[index, position])!r}; "
            "components must be finite and fit float32"
        )
    return np.array(matrix, dtype="<f4")


def validate_vector(identity_or_provider: Any, vector: Any) -> list[float]:
    """Check one vector (an ``embed_query`` result); see ``validate_vectors``."""
    return validate_vectors(identity_or_provider, 1, [vector])[0]


def _checked_vector(dimension: int, index: int, vector: Any) -> list[float]:
    if not isinstance(vector, (list, tuple)):
        raise InvalidEmbedding(
            f"vector {index}: expected a list of floats, got {type(vector).__name__}"
        )
    if len(vector) != dimension:
        raise InvalidEmbedding(
            f"vector {index}: has {len(vector)} components, the provider declares "
            f"dimension {dimension}"
        )
    if not set(map(type, vector)) <= _PLAIN_NUMBERS:
        for position, value in enumerate(vector):
            if not _is_real(value):
                raise InvalidEmbedding(
                    f"vector {index}: component {position} is {type(value).__name__} "
                    f"{value!r}, not a real number"
                )
    try:
        array = np.array(vector, dtype=np.float64)
    except OverflowError as error:
        raise InvalidEmbedding(f"vector {index}: a component does not fit float32") from error
    bad = ~np.isfinite(array) | (np.abs(array) > FLOAT32_MAX)
    if bad.any():
        position = int(np.argmax(bad))
        raise InvalidEmbedding(
            f"vector {index}: component {position} is {vector[position]!r}; components must "
            "be finite and fit float32"
        )
    return array.tolist()


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
