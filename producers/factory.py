"""Open the log transport the settings name."""

from __future__ import annotations

from pathlib import Path

from prme.schemas.config import Settings

from .transport import LogTransport


def open_transport(settings: Settings) -> LogTransport:
    """A not-yet-started transport: ``local`` under ``data_dir`` or ``kafka`` at ``bootstrap``."""
    log = settings.log
    if log.transport == "kafka":
        from .kafka_log import KafkaLogTransport

        return KafkaLogTransport(
            log.bootstrap,
            log.topic,
            log.partitions,
            request_timeout_s=log.request_timeout_s,
            transactional_id=log.transactional_id,
        )
    from .local_log import LocalLogTransport

    return LocalLogTransport(Path(settings.data_dir) / "log.sqlite3", log.partitions)
