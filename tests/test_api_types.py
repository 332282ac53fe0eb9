"""One declaration per idea at the API edge: the error table read both ways, the request
Structs the HTTP client encodes, and the sync client's surface mirroring the async one."""

from __future__ import annotations

import inspect

import msgspec
import pytest

from prme import AsyncMemoryClient, MemoryClient, MemoryEngine
from prme.producers.producer import MessageDraft
from prme.query.http_client import HttpMemoryBackend
from prme.query.http_errors import ERROR_STATUS, error_of, status_of
from prme.query.http_types import HistoryWriteRequest, MemoryIn, StoreManyRequest
from prme.schemas.errors import InvalidInput, PRMEError

PUBLIC = [
    name
    for name, member in inspect.getmembers(AsyncMemoryClient, inspect.iscoroutinefunction)
    if not name.startswith("_") and name != "close"
]


@pytest.mark.parametrize(("error_type", "status", "kind"), ERROR_STATUS)
def test_every_error_comes_back_from_http_as_the_exception_it_left_as(
    error_type: type[PRMEError], status: int, kind: str
) -> None:
    assert status_of(error_type("boom")) == (status, kind)
    back = error_of(kind, status, "boom")
    assert type(back) is error_type and "boom" in str(back)


def test_an_error_without_a_kind_is_read_by_its_status() -> None:
    assert type(error_of("", 413, "too big")) is InvalidInput
    assert type(error_of("", 418, "teapot")) is PRMEError


def test_the_sync_client_spells_out_the_async_clients_signatures() -> None:
    assert len(PUBLIC) >= 14
    for name in (n for n in PUBLIC if not n.endswith("_request")):
        sync = inspect.signature(getattr(MemoryClient, name))
        async_ = inspect.signature(getattr(AsyncMemoryClient, name))
        assert sync.parameters == async_.parameters, name
        assert sync.return_annotation == async_.return_annotation, name


@pytest.mark.parametrize("backend", [MemoryEngine, HttpMemoryBackend])
def test_both_backends_offer_the_clients_methods_with_its_parameters(backend: type) -> None:
    for name in PUBLIC:
        ours = inspect.signature(getattr(backend, name)).parameters
        assert ours == inspect.signature(getattr(AsyncMemoryClient, name)).parameters, name


def test_a_batch_body_is_the_struct_the_service_decodes() -> None:
    draft = MessageDraft(owner="alice", content="hi", session_id="s", name="Al", fields={"x": 1})
    body = msgspec.json.encode(StoreManyRequest(messages=[MemoryIn.of_draft(draft)]))
    decoded = msgspec.json.decode(body, type=StoreManyRequest)
    assert decoded.messages[0].draft() == draft


def test_a_history_body_refuses_a_message_of_another_history() -> None:
    draft = MessageDraft(owner="bob", content="hi", session_id="s")
    with pytest.raises(InvalidInput, match="belong"):
        HistoryWriteRequest.of("alice", "s", [draft], scope="default", wait=True, mismatch="belong")
    ok = HistoryWriteRequest.of("bob", "s", [draft], scope="default", wait=False, mismatch="x")
    assert ok.drafts() == [draft]


def test_a_503_invites_a_retry_unless_something_was_written() -> None:
    """From a Kafka fault trial: ``503 transport_unavailable`` ("nothing of it was written
    (safe to send again)") came without the ``Retry-After`` HTTP.md promises."""
    from prme.query.service import on_prme_error
    from prme.schemas.errors import ShardUnavailable, TransportError, TransportUnavailable

    for error in (
        TransportError("kafka: atomic append timed out; nothing of it was written"),
        TransportUnavailable("kafka: poll failed"),
        ShardUnavailable("no node serves partition 4 yet"),
    ):
        response = on_prme_error(None, error)  # type: ignore[arg-type]
        assert response.status_code == 503
        assert response.headers["Retry-After"] == "1"
    written = ShardUnavailable("appended, then the owner went away")
    written.written = [{"event_id": "e"}]  # type: ignore[attr-defined]
    assert "Retry-After" not in on_prme_error(None, written).headers  # type: ignore[arg-type]


async def test_kafka_errors_that_pass_are_transient_and_the_others_are_not() -> None:
    import asyncio

    from aiokafka.errors import KafkaConnectionError, TopicAuthorizationFailedError

    from prme.producers.kafka_common import bounded
    from prme.schemas.errors import TransportError, TransportUnavailable

    async def fails(error: Exception) -> None:
        raise error

    with pytest.raises(TransportUnavailable, match="timed out after 0.01s"):
        await bounded(asyncio.sleep(1), 0.01, "changelog publish")
    with pytest.raises(TransportUnavailable, match="KafkaConnectionError"):
        await bounded(fails(KafkaConnectionError("broker down")), 1, "poll")
    with pytest.raises(TransportError) as refused:
        await bounded(fails(TopicAuthorizationFailedError()), 1, "poll")
    assert not isinstance(refused.value, TransportUnavailable)
