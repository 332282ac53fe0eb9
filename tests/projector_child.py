"""A projector process the convergence and replication tests kill: projects the log named
by ``PRME_TEST_SETTINGS`` into its data directory until caught up, prints how many texts
it encoded, then exits."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import msgspec

from prme.producers.factory import open_transport
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.runner import ProjectorRunner
from prme.schemas.config import Settings


class CountingProvider(HashedBagOfWordsProvider):
    """The hashed provider (same identity), counting the texts it encodes."""

    encoded = 0

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        self.encoded += len(texts)
        return await super().embed(texts)


async def main() -> None:
    settings = msgspec.json.decode(os.environ["PRME_TEST_SETTINGS"], type=Settings)
    transport = open_transport(settings)
    await transport.start()
    provider = CountingProvider()
    runner = ProjectorRunner(
        settings,
        transport,
        provider,
        group=os.environ["PRME_TEST_GROUP"],
        batch_size=int(os.environ.get("PRME_TEST_BATCH", "64")),
    )
    await runner.start()
    print("started", flush=True)
    await runner.catch_up(timeout_s=300)
    print("caught-up", flush=True)
    print(f"encoded {provider.encoded}", flush=True)
    await runner.close()
    await transport.close()


if __name__ == "__main__":
    asyncio.run(main())
