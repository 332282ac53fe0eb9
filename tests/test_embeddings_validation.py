"""Boundary checks on provider identity and responses (CUSTOM-EMBEDDINGS: validation)."""

from __future__ import annotations

import array
import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np
import pytest

from prme.projectors.embeddings.hashed import (
    HashedBagOfWordsProvider,
    HashedBagOfWordsQueryProvider,
)
from prme.projectors.embeddings.protocol import (
    EmbeddingIdentity,
    EmbeddingProvider,
    QueryEmbeddingProvider,
    array_encoder,
)
from prme.projectors.embeddings.validation import (
    FLOAT32_MAX,
    check_identity_unchanged,
    check_texts,
    checked_vectors,
    identity_of,
    validate_array,
    validate_vector,
    validate_vectors,
)
from prme.schemas.errors import InvalidEmbedding, PRMEError

IDENTITY = EmbeddingIdentity("test/model", "v1", 3)


class Meta:
    def __init__(self, model_name: object, model_version: object, dimension: object) -> None:
        self.model_name = model_name
        self.model_version = model_version
        self.dimension = dimension


def test_identity_of_reads_name_version_and_dimension() -> None:
    assert identity_of(Meta("m", "v", 4)) == EmbeddingIdentity("m", "v", 4)
    assert identity_of(IDENTITY) is not None
    assert identity_of(IDENTITY).key == "test/model|v1|3"


@pytest.mark.parametrize(
    ("name", "version", "dimension"),
    [
        ("", "v", 4),
        ("   ", "v", 4),
        (None, "v", 4),
        ("m", "", 4),
        ("m", 1, 4),
        ("m", "v", 0),
        ("m", "v", -3),
        ("m", "v", True),
        ("m", "v", 4.0),
        ("m", "v", "4"),
    ],
)
def test_identity_of_rejects_empty_names_and_non_positive_int_dimensions(
    name: object, version: object, dimension: object
) -> None:
    with pytest.raises(ValueError):
        identity_of(Meta(name, version, dimension))


def test_identity_of_rejects_an_object_without_metadata() -> None:
    with pytest.raises(ValueError, match="model_version"):
        identity_of(type("Half", (), {"model_name": "m"})())


def test_validation_errors_belong_to_the_package_hierarchy() -> None:
    with pytest.raises(InvalidEmbedding) as caught:
        validate_vectors(IDENTITY, 1, [])
    assert isinstance(caught.value, PRMEError)
    assert isinstance(caught.value, ValueError)


def test_identity_change_is_detected() -> None:
    provider = Meta("m", "v1", 3)
    expected = identity_of(provider)
    check_identity_unchanged(expected, provider)
    provider.model_version = "v2"
    with pytest.raises(ValueError, match="changed"):
        check_identity_unchanged(expected, provider)
    provider.model_version = "v1"
    provider.dimension = 4
    with pytest.raises(ValueError, match="changed"):
        check_identity_unchanged(expected, provider)


def test_valid_vectors_come_back_as_fresh_float_lists() -> None:
    source = [[1, 2.5, -3], (0.0, 1e-3, np.float32(0.5))]
    result = validate_vectors(IDENTITY, 2, source)
    assert result == [[1.0, 2.5, -3.0], [0.0, 1e-3, 0.5]]
    assert all(type(value) is float for vector in result for value in vector)
    assert result[0] is not source[0]
    result[0][0] = 99.0
    assert source[0][0] == 1


def test_checked_float_lists_are_handed_back_as_they_are_and_others_copied() -> None:
    floats = [[1.0, 2.5, -3.0], [0.0, 1e-3, 0.5]]
    kept = checked_vectors(IDENTITY, floats)
    assert kept is floats and all(a is b for a, b in zip(kept, floats, strict=True))
    mixed = [[1, 2.5, -3], (0.0, 1e-3, np.float32(0.5))]
    copied = checked_vectors(IDENTITY, mixed)
    assert copied == [[1.0, 2.5, -3.0], [0.0, 1e-3, 0.5]] and copied[0] is not mixed[0]
    assert all(type(value) is float for vector in copied for value in vector)


def test_checked_float32_vectors_are_handed_back_as_they_are() -> None:
    vectors = [array.array("f", [1.0, 2.5, -3.0]), array.array("f", [0.0, 1e-3, 0.5])]
    kept = checked_vectors(IDENTITY, vectors)
    assert kept is vectors


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (array.array("f", [0.0, math.nan, 0.0]), "vector 1: component 1 is nan"),
        (array.array("f", [0.0, 0.0, math.inf]), "vector 1: component 2 is inf"),
        (array.array("f", [0.0, 1.0]), "vector 1: has 2 components"),
        (array.array("d", [0.0, 1.0, 0.0]), "vector 1: expected a list"),
    ],
)
def test_a_malformed_float32_vector_is_rejected_naming_its_index(
    bad: array.array[float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        checked_vectors(IDENTITY, [array.array("f", [0.0, 0.0, 1.0]), bad])


def test_rational_numbers_are_real_numbers() -> None:
    assert validate_vector(IDENTITY, [Fraction(1, 2), 0, 1]) == [0.5, 0.0, 1.0]


@pytest.mark.parametrize("count", [1, 3])
def test_exactly_one_vector_per_input(count: int) -> None:
    with pytest.raises(ValueError, match=f"returned 2 vectors for {count} inputs"):
        validate_vectors(IDENTITY, count, [[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])


def test_no_inputs_accept_no_vectors() -> None:
    assert validate_vectors(IDENTITY, 0, []) == []


@pytest.mark.parametrize(
    "vectors",
    [
        np.zeros((1, 3)),
        "abc",
        {0: [0.0, 0.0, 1.0]},
        None,
    ],
)
def test_response_must_be_a_list_of_vectors(vectors: object) -> None:
    with pytest.raises(ValueError, match="list of vectors"):
        validate_vectors(IDENTITY, 1, vectors)


@pytest.mark.parametrize(
    ("vector", "message"),
    [
        ([0.0, 1.0], "vector 1: has 2 components"),
        ([0.0, 1.0, 0.0, 0.0], "vector 1: has 4 components"),
        ([[0.0], [1.0], [0.0]], "vector 1: component 0 is list"),
        (0.5, "vector 1: expected a list"),
        ("0.1 0.2 0.3", "vector 1: expected a list"),
        (np.zeros(3), "vector 1: expected a list"),
        ([0.0, "1.0", 0.0], "vector 1: component 1 is str '1.0'"),
        ([0.0, b"1", 0.0], "vector 1: component 1 is bytes"),
        ([True, 0.0, 0.0], "vector 1: component 0 is bool"),
        ([np.bool_(True), 0.0, 0.0], "vector 1: component 0 is bool"),
        ([0.0, 0.0, None], "vector 1: component 2 is NoneType"),
        ([0.0, 0.0, 1j], "vector 1: component 2 is complex"),
        ([0.0, math.nan, 0.0], "vector 1: component 1 is nan"),
        ([0.0, 0.0, math.inf], "vector 1: component 2 is inf"),
        ([-math.inf, 0.0, 0.0], "vector 1: component 0 is -inf"),
        ([0.0, FLOAT32_MAX * 2, 0.0], "vector 1: component 1"),
        ([0.0, 0.0, -(10**39)], "vector 1: component 2"),
        ([10**400, 0.0, 0.0], "vector 1: a component does not fit float32"),
    ],
)
@pytest.mark.parametrize("check", ["validate_vectors", "checked_vectors"])
def test_each_malformed_vector_is_rejected_naming_its_index(
    vector: object, message: str, check: str
) -> None:
    good = [0.0, 0.0, 1.0]
    with pytest.raises(ValueError) as caught:
        if check == "validate_vectors":
            validate_vectors(IDENTITY, 2, [good, vector])
        else:
            checked_vectors(IDENTITY, [good, vector])
    assert message in str(caught.value)


def test_float32_extremes_are_accepted() -> None:
    assert validate_vector(IDENTITY, [FLOAT32_MAX, -FLOAT32_MAX, 1e-45]) == [
        FLOAT32_MAX,
        -FLOAT32_MAX,
        1e-45,
    ]


def test_a_provider_is_accepted_in_place_of_an_identity() -> None:
    provider = HashedBagOfWordsProvider(dimension=3)
    assert validate_vectors(provider, 1, [[0.0, 0.0, 1.0]]) == [[0.0, 0.0, 1.0]]
    with pytest.raises(ValueError, match="dimension 3"):
        validate_vectors(provider, 1, [[0.0, 1.0]])


def test_checks_cannot_detect_a_reordered_response() -> None:
    # Order and semantics remain provider contracts: a permuted batch is well-formed.
    vectors = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    assert validate_vectors(IDENTITY, 2, vectors[::-1]) == vectors[::-1]


def test_texts_must_be_a_sequence_of_str() -> None:
    assert check_texts(("a", "b")) == ["a", "b"]
    with pytest.raises(TypeError, match="single str"):
        check_texts("ab")
    with pytest.raises(TypeError, match="text 1 is int"):
        check_texts(["a", 1])  # type: ignore[list-item]


def test_protocols_are_structural() -> None:
    plain = HashedBagOfWordsProvider()
    with_query = HashedBagOfWordsQueryProvider()
    assert isinstance(plain, EmbeddingProvider)
    assert not isinstance(plain, QueryEmbeddingProvider)
    assert isinstance(with_query, QueryEmbeddingProvider)
    assert not isinstance(Meta("m", "v", 3), EmbeddingProvider)


async def test_hashed_bag_of_words_is_deterministic_and_word_sensitive() -> None:
    provider = HashedBagOfWordsProvider(dimension=32)
    first, again, other, empty = await provider.embed(
        ["Aurora deploys today", "aurora DEPLOYS today", "lunch menu", ""]
    )
    assert first == again
    assert first != other
    assert validate_vectors(provider, 4, [first, again, other, empty])
    assert math.isclose(sum(value * value for value in first), 1.0)
    assert empty == [1.0] + [0.0] * 31


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_a_float_array_is_checked_and_handed_back_as_a_float32_copy(dtype: type) -> None:
    source = np.array([[1.0, 0.5, -0.25], [0.0, 0.0, 1.0]], dtype=dtype)
    checked = validate_array(IDENTITY, 2, source)
    assert checked.dtype == np.float32 and checked.tolist() == source.astype(np.float32).tolist()
    checked[0, 0] = 9.0
    assert source[0, 0] == 1.0
    assert validate_array(IDENTITY, 0, np.zeros((0, 3))).shape == (0, 3)


@pytest.mark.parametrize(
    ("matrix", "message"),
    [
        ([[0.0, 0.0, 1.0]], "must return a 2-D float array, got list"),
        (np.zeros(3), "got a 1-D array"),
        (np.zeros((1, 1, 3)), "got a 3-D array"),
        (np.zeros((1, 3), dtype=np.int64), "a float array, got int64"),
        (np.array([["a", "b", "c"]]), "a float array, got <U1"),
        (np.zeros((2, 3)), "returned 2 vectors for 1 inputs"),
        (np.zeros((1, 4)), "vector 0: has 4 components, the provider declares dimension 3"),
        (np.array([[0.0, np.nan, 0.0]]), "vector 0: component 1 is nan"),
        (np.array([[0.0, 0.0, 0.0], [0.0, 0.0, -np.inf]])[1:], "vector 0: component 2 is -inf"),
        (np.array([[0.0, FLOAT32_MAX * 2, 0.0]]), "vector 0: component 1 is 6.8"),
        (np.ma.masked_invalid(np.array([[0.0, np.nan, 1.0]])), "not a masked one"),
    ],
)
def test_a_malformed_array_response_is_rejected_naming_what_is_wrong(
    matrix: object, message: str
) -> None:
    with pytest.raises(InvalidEmbedding, match=message):
        validate_array(IDENTITY, 1, matrix)


def test_the_array_path_is_used_only_where_embed_is_the_one_beside_it() -> None:
    plain = HashedBagOfWordsProvider(3)
    assert array_encoder(plain) == plain.embed_array

    class OwnRecipe(HashedBagOfWordsProvider):
        async def embed(self, texts: Sequence[str]) -> list[list[float]]:
            return await super().embed([text.upper() for text in texts])

    class OwnRecipeAndArray(OwnRecipe):
        async def embed_array(self, texts: Sequence[str]) -> np.ndarray:
            return np.array(await self.embed(texts))

    patched = HashedBagOfWordsProvider(3)
    patched.embed = OwnRecipe(3).embed  # type: ignore[method-assign]
    assert array_encoder(OwnRecipe(3)) is None
    assert array_encoder(patched) is None
    assert array_encoder(HashedBagOfWordsQueryProvider(3)) is not None
    both = OwnRecipeAndArray(3)
    assert array_encoder(both) == both.embed_array
    assert array_encoder(Meta("m", "v", 3)) is None
