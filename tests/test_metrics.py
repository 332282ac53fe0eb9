"""``GET /metrics``: writes, retrieves and a rebuild move the right series by the right
amounts, the lag returns to 0, and no label (nor any line) carries an owner or a query."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prme.producers.producer import MessageDraft
from prme.projectors.status import partition_statuses
from prme.query.engine import MemoryEngine
from prme.query.service import create_app
from prme.schemas.config import Settings

OWNER = "owner-7f3a-private"
QUERY = "Which secret launch code did Dana approve"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over every sample whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


async def scrape(http: httpx.AsyncClient) -> tuple[str, Samples]:
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return response.text, parse(response.text)


@pytest.fixture
async def engine(local_settings: Settings, hashed_provider: Any) -> AsyncIterator[MemoryEngine]:
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    yield engine
    await engine.close()


async def test_writes_retrieves_and_a_rebuild_move_the_series(
    engine: MemoryEngine, http: httpx.AsyncClient
) -> None:
    _, before = await scrape(http)
    texts = [f"Dana approved launch code {i} for project Aurora" for i in range(5)]
    for text in texts:
        stored = await http.post("/v1/memories", json={"user_id": OWNER, "content": text})
        assert stored.status_code == 201, stored.text
    batch = [{"user_id": OWNER, "content": f"batch note {i} about Aurora"} for i in range(3)]
    assert (await http.post("/v1/memories/batch", json={"messages": batch})).status_code == 201
    for _ in range(2):
        again = {"user_id": OWNER, "content": "retried once", "request_id": "r-1"}
        assert (await http.post("/v1/memories", json=again)).status_code == 201
    for _ in range(2):
        found = await http.post("/v1/retrieve", json={"user_id": OWNER, "query": QUERY})
        assert found.status_code == 200 and found.json()["results"]
    assert (await http.get("/v1/events/nope", params={"user_id": OWNER})).status_code == 404
    await engine.rebuild(["vector"])

    text, after = await scrape(http)

    def moved(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    written = len(texts) + len(batch) + 1  # the retried request is written once
    assert moved("prme_log_appended_records_total", transport="local") == written + 1
    assert moved("prme_log_dedupe_hits_total", transport="local") == 1
    assert moved("prme_log_append_duration_seconds_count", transport="local") == 5 + 1 + 2
    assert moved("prme_projector_records_applied_total") == written
    assert moved("prme_projector_batch_records_sum") == written
    for model in ("vector", "lexical", "graph", "history", "events"):
        assert moved("prme_projector_apply_duration_seconds_count", model=model) >= 1, model
    assert moved("prme_projector_dead_letters_total") == 0

    http_count = "prme_http_request_duration_seconds_count"
    assert moved(http_count, route="/v1/memories", method="POST", status="2xx") == 7
    assert moved(http_count, route="/v1/memories/batch", method="POST", status="2xx") == 1
    assert moved(http_count, route="/v1/retrieve", method="POST", status="2xx") == 2
    assert moved(http_count, route="/v1/events/{event_id}", status="4xx") == 1
    assert total(after, "prme_http_requests_in_flight") == 1  # this scrape

    for stage in ("vector", "lexical", "query_embedding", "fusion", "stages", "bundle", "total"):
        assert moved("prme_retrieve_duration_seconds_count", stage=stage) == 2, stage
    assert moved("prme_retrieve_requests_total") == 2
    assert moved("prme_retrieve_min_score_skipped_total") == 0

    # Each distinct text was encoded once on the way in; the rebuild found all in the cache.
    assert moved("prme_embedding_texts_encoded_total", task="document") == written
    assert moved("prme_embedding_texts_encoded_total", task="query") == 2
    assert moved("prme_embedding_cache_lookups_total", cache="durable", result="hit") == written
    assert moved("prme_embedding_cache_lookups_total", cache="durable", result="miss") == written
    replayed = total(after, "prme_rebuild_replayed_records")
    assert replayed == total(after, "prme_rebuild_target_records") == written

    assert total(after, "prme_projector_lag_records") == 0
    assert total(after, "prme_projector_lag_seconds") == 0
    assert total(after, "prme_projector_log_end_offset") == written
    partitions = {dict(ls)["partition"] for (n, ls) in after if n == "prme_projector_lag_records"}
    assert partitions == {str(p) for p in range(4)}

    assert OWNER not in text and "Dana" not in text and "secret" not in text
    for (_, labels), _value in after.items():
        for _label, value in labels:
            assert OWNER not in value and QUERY not in value


async def test_lag_counts_records_written_and_not_yet_applied(
    engine: MemoryEngine, http: httpx.AsyncClient
) -> None:
    """While the projector cannot apply (its apply lock held), two appended records are
    lag in /v1/ready, in /metrics and in the partition status; applied, the lag is 0."""
    async with engine.runner._apply_lock:  # noqa: SLF001 - holds the projector back
        results = await engine.store_many(
            [MessageDraft(owner=OWNER, content=f"late {i}") for i in range(2)], wait=False
        )
        partition = results[0].token.partition
        statuses = {s.partition: s for s in await partition_statuses(engine.runner)}
        assert statuses[partition].lag_records == 2
        assert 0 <= statuses[partition].lag_seconds < 60
        assert sum(s.lag_records for s in statuses.values()) == 2
        assert (await http.get("/v1/ready")).json()["lag"] == 2
        _, samples = await scrape(http)
        assert total(samples, "prme_projector_lag_records", partition=str(partition)) == 2
    await engine.wait_for([r.token for r in results])
    assert (await http.get("/v1/ready")).json()["lag"] == 0
    _, samples = await scrape(http)
    assert total(samples, "prme_projector_lag_records") == 0


async def test_metrics_off_records_nothing(local_settings: Settings, hashed_provider: Any) -> None:
    settings = local_settings.replace(metrics={"enabled": False})
    async with await MemoryEngine.create(
        settings=settings, embedding_provider=hashed_provider
    ) as e:
        transport = httpx.ASGITransport(app=create_app(e))
        async with httpx.AsyncClient(transport=transport, base_url="http://prme") as client:
            await client.post("/v1/memories", json={"user_id": OWNER, "content": "x"})
            response = await client.get("/metrics")
    assert response.status_code == 200 and response.text == ""


@pytest.mark.kafka
async def test_an_idle_caught_up_kafka_node_reports_lag_zero(
    kafka_settings: Settings, hashed_provider: Any
) -> None:
    """Transaction markers take offsets no record has: once everything is applied, the
    lag is 0 in /v1/ready and /metrics, although log ends lie past the last records."""
    async with await MemoryEngine.create(
        settings=kafka_settings, embedding_provider=hashed_provider
    ) as engine:
        for i in range(6):
            owner = f"user{i}"
            drafts = [MessageDraft(owner=owner, content=f"{owner} note {j}") for j in range(2)]
            await engine.store_many(drafts)  # one transaction each: a commit marker each
        await engine.store("written without a transaction", "user0")
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://prme") as client:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while True:
                statuses = await partition_statuses(engine.runner)
                ready = (await client.get("/v1/ready")).json()
                if ready["lag"] == 0 and not any(s.lag_records for s in statuses):
                    break
                assert loop.time() < deadline, (ready, statuses)
                await asyncio.sleep(0.2)  # poll interval while the consumer steps over markers
            _, samples = await scrape(client)
        assert ready["ready"] is True and sorted(ready["partitions"]) == [0, 1, 2, 3]
        assert any(s.log_end > s.applied_offset + 1 for s in statuses)  # markers are there
        assert total(samples, "prme_projector_lag_records") == 0
        assert total(samples, "prme_projector_records_applied_total") == 13


def test_texts_encoded_is_zero_not_absent_before_any_encoding() -> None:
    """A node that restored every vector encodes none: its series read 0 (a cluster trial
    found them missing, so '0 texts encoded' could only be read as an absent series)."""
    from prme.schemas.metrics import Metrics

    samples = parse(Metrics(enabled=True).render().decode())
    for task in ("document", "query"):
        key = ("prme_embedding_texts_encoded_total", frozenset({("task", task)}))
        assert samples[key] == 0


async def test_a_closed_standby_forgets_what_it_read_of_its_changelog(
    local_settings: Settings, hashed_provider: Any, tmp_path: Any
) -> None:
    """A standby closed, and later taken over, was opened as restored: the vectors its
    owner published meanwhile were not loaded, and the node encoded those texts again
    (cluster trial). Closing it now forgets the partition's changelog state."""
    from prme.producers.local_log import LocalLogTransport
    from prme.projectors.runner import ProjectorRunner
    from prme.projectors.vector_changelog import VectorChangelog

    transport = LocalLogTransport(tmp_path / "log.sqlite3", 4)
    runner = ProjectorRunner(local_settings, transport, hashed_provider)
    runner.changelog = VectorChangelog(
        object(),  # type: ignore[arg-type]  # (no log is read: restored/forget only)
        runner.vector_cache,
        runner.identity,
    )
    runner.changelog._known[2], runner.changelog._read_to[2] = {}, 7
    assert runner.changelog.restored(2)
    runner._released(2)  # what the standby keeper calls when it closes a standby
    assert not runner.changelog.restored(2)
    runner.vector_cache.close()
