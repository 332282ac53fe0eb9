"""Property-based fuzzing (hypothesis): the record decoder raises only its documented
errors, no request body makes the service answer 5xx, and garbage on the log never stops
the projector (it goes to the dead letters)."""

from __future__ import annotations

import asyncio
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prme.producers.transport import LogItem
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.query.engine import MemoryEngine
from prme.schemas.codec import decode_record, record_from_json
from prme.schemas.config import Settings
from prme.schemas.errors import RecordDecodeError
from prme.schemas.records import KINDS, Record

from .live_server import ServerThread

FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)

# -- values ---------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.datetimes().map(str)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.integers(0, 3), inner, max_size=4)
    ),
    max_leaves=12,
)
ENVELOPE = {
    "event_id": "0190a000-0000-7000-8000-000000000001",
    "owner": "alice",
    "recorded_at": "2024-03-01T12:00:00Z",
}
FIELD_NAMES = sorted(
    {f.name for t in Record.__subclasses__() for f in msgspec.structs.fields(t)} | {"kind", "v"}
)
record_like = st.fixed_dictionaries(
    {"kind": st.sampled_from(sorted(KINDS)) | st.text(max_size=6)},
    optional={
        "v": st.integers(-3, 5) | msgpack_scalars,
        **{name: msgpack_values for name in FIELD_NAMES if name not in ("kind", "v")},
    },
).map(lambda fields: {**ENVELOPE, **fields})


# -- 1: the record decoder ---------------------------------------------------------------


def _decodes_or_says_why(data: bytes) -> None:
    try:
        record = decode_record(data)
    except RecordDecodeError:
        return
    assert isinstance(record, Record)


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes_decode_or_raise_a_record_decode_error(data: bytes) -> None:
    _decodes_or_says_why(data)


@FUZZ
@given(msgpack_values)
def test_arbitrary_msgpack_decodes_or_raises_a_record_decode_error(value: Any) -> None:
    _decodes_or_says_why(msgspec.msgpack.encode(value))


@FUZZ
@given(record_like)
def test_record_shaped_msgpack_decodes_or_raises_a_record_decode_error(fields: Any) -> None:
    _decodes_or_says_why(msgspec.msgpack.encode(fields))


@FUZZ
@given(st.text(max_size=200) | json_values.map(lambda v: msgspec.json.encode(v).decode()))
def test_arbitrary_json_decodes_or_raises_a_record_decode_error(text: str) -> None:
    try:
        record_from_json(text)
    except RecordDecodeError:
        return


# -- 2: no request body makes the service answer 5xx ---------------------------------------

KEYS = {"key-admin": "*", "key-alice": "alice"}
ROUTES = [
    ("POST", "/v1/memories"),
    ("POST", "/v1/memories/batch"),
    ("POST", "/v1/retrieve"),
    ("POST", "/v1/history/messages"),
    ("POST", "/v1/history/replace"),
    ("POST", "/v1/history/clear"),
    ("POST", "/v1/nodes/mem:x/archive"),
    ("POST", "/v1/nodes/mem:x/restore"),
    ("POST", "/v1/nodes/mem:x/supersede"),
]
VALID = {
    "user_id": "alice",
    "content": "the spare key is under the blue pot",
    "query": "spare key",
    "session_id": "s1",
    "messages": [{"content": "hello"}],
    "by_node_id": "mem:y",
}


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    data_dir = tmp_path_factory.mktemp("fuzz-http") / "pack"
    server_settings = Settings(data_dir=str(data_dir)).replace(
        log={"partitions": 4}, service={"api_keys": KEYS}, limits={"max_body_bytes": 64 * 1024}
    )
    server = ServerThread(server_settings, HashedBagOfWordsProvider())
    server.start()
    try:
        headers = {"Authorization": "Bearer key-admin"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
            yield client
    finally:
        server.stop()


def _answer(client: httpx.Client, method: str, path: str, body: bytes) -> httpx.Response:
    response = client.request(
        method, path, content=body, headers={"Content-Type": "application/json"}
    )
    assert response.status_code < 500, (method, path, body, response.text)
    assert set(response.json()) >= ({"error", "detail"} if response.status_code >= 400 else set())
    return response


# A body close to a valid one, one field replaced or added: where decoders and the
# producer's checks meet.
mutated_bodies = st.builds(
    lambda base, name, value: {**base, name: value},
    st.just(VALID),
    st.sampled_from(
        sorted(
            {
                *VALID,
                "top_k",
                "token_budget",
                "after",
                "metadata",
                "fields",
                "tool_calls",
                "request_id",
                "occurred_at",
                "role",
                "scope",
                "min_score",
                "fusion",
                "wait",
                "limit",
                "reason",
                "name",
                "message_id",
                "include_archived",
            }
        )
    ),
    json_values,
)


@settings(FUZZ, max_examples=60)
@given(st.sampled_from(ROUTES), mutated_bodies | json_values)
def test_no_json_body_makes_the_service_answer_5xx(
    service: httpx.Client, route: tuple[str, str], body: Any
) -> None:
    body = _without_waiting(body)
    _answer(service, *route, msgspec.json.encode(body))


@settings(FUZZ, max_examples=40)
@given(
    st.sampled_from(ROUTES),
    st.binary(max_size=300)
    | st.text(alphabet=string.printable + '\\"{}[]:,\ud7ff\ue000', max_size=120).map(str.encode),
)
def test_no_raw_body_makes_the_service_answer_5xx(
    service: httpx.Client, route: tuple[str, str], body: bytes
) -> None:
    _answer(service, *route, body)


def _without_waiting(body: Any) -> Any:
    """``wait: false`` keeps the run fast: the projector's work is not what is fuzzed."""
    if isinstance(body, dict) and "wait" not in body:
        return {**body, "wait": False}
    return body


# -- 3: garbage on the log never stops the projector -------------------------------------------

garbage = st.tuples(
    st.sampled_from([b"alice", b"bob", b"", b"\xff\xfe", "josé".encode()]),
    st.binary(max_size=64)
    | msgpack_values.map(msgspec.msgpack.encode)
    | record_like.map(msgspec.msgpack.encode),
)


def test_garbage_on_the_log_is_dead_lettered_and_projection_goes_on(tmp_path: Path) -> None:
    settings_ = Settings(data_dir=str(tmp_path / "pack")).replace(log={"partitions": 4})
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(
        MemoryEngine.create(settings=settings_, embedding_provider=HashedBagOfWordsProvider())
    )
    rounds = 0

    @settings(FUZZ, max_examples=25)
    @given(st.lists(garbage, min_size=1, max_size=12))
    def appending(entries: list[tuple[bytes, bytes]]) -> None:
        nonlocal rounds
        rounds += 1

        async def run() -> None:
            transport = engine.runner.transport
            for key, value in entries:
                await transport.append(LogItem(key, value))
            stored = await engine.store(f"still projecting round {rounds}", "alice")
            assert engine.runner.failure is None
            found = await engine.retrieve(f"still projecting round {rounds}", "alice", top_k=50)
            assert stored.event_id in [r.event_id for r in found.results]

        loop.run_until_complete(run())

    try:
        appending()
        assert engine.runner.failure is None
        assert engine.runner.dead_letter_count > 0
    finally:
        loop.run_until_complete(engine.close())
        loop.close()
