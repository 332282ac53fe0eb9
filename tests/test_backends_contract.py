"""The MemoryBackend contract on both backends: the embedded engine and the HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from prme.query.backend import MemoryBackend
from prme.query.engine import MemoryEngine
from prme.query.http_client import HttpMemoryBackend
from prme.query.service import create_app
from prme.schemas.config import Settings

from .backend_contract import MemoryBackendContract


@pytest.fixture
async def engine(local_settings: Settings, hashed_provider: Any) -> AsyncIterator[MemoryEngine]:
    engine = await MemoryEngine.create(settings=local_settings, embedding_provider=hashed_provider)
    yield engine
    await engine.close()


class TestEmbeddedBackend(MemoryBackendContract):
    @pytest.fixture
    def backend(self, engine: MemoryEngine) -> MemoryBackend:
        return engine


class TestHttpBackend(MemoryBackendContract):
    @pytest.fixture
    async def backend(self, engine: MemoryEngine) -> AsyncIterator[MemoryBackend]:
        settings = engine.settings.replace(service={"api_keys": {"key-admin": "*"}})
        transport = httpx.ASGITransport(app=create_app(engine, settings))
        async with HttpMemoryBackend(
            "http://prme", "key-admin", timeout_s=30, transport=transport
        ) as backend:
            yield backend
