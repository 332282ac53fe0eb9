"""A projector process the convergence test kills: projects the log named by
``PRME_TEST_SETTINGS`` into its data directory until caught up, then exits."""

from __future__ import annotations

import asyncio
import os

import msgspec

from prme.producers.factory import open_transport
from prme.projectors.embeddings.hashed import HashedBagOfWordsProvider
from prme.projectors.runner import ProjectorRunner
from prme.schemas.config import Settings


async def main() -> None:
    settings = msgspec.json.decode(os.environ["PRME_TEST_SETTINGS"], type=Settings)
    transport = open_transport(settings)
    await transport.start()
    runner = ProjectorRunner(
        settings,
        transport,
        HashedBagOfWordsProvider(),
        group=os.environ["PRME_TEST_GROUP"],
        batch_size=int(os.environ.get("PRME_TEST_BATCH", "64")),
    )
    await runner.start()
    print("started", flush=True)
    await runner.catch_up(timeout_s=300)
    print("caught-up", flush=True)
    await runner.close()
    await transport.close()


if __name__ == "__main__":
    asyncio.run(main())
