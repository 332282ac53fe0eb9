"""Open the log transports the settings name: the event log and the dead-letter log.

The backend (``local`` SQLite under ``data_dir`` or ``kafka`` at ``bootstrap``) is chosen
here and nowhere else; the engine, the CLI and the workers all open their logs through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prme.schemas.config import Settings

from .transport import LogTransport

if TYPE_CHECKING:
    from .kafka_changelog import KafkaChangelog
    from .keys import KeyStore


LOCAL_LOG_FILE = "log.sqlite3"
"""The embedded log's file in the data directory."""


def open_transport(settings: Settings) -> LogTransport:
    """A not-yet-started transport for the event log."""
    return _open_log(
        settings,
        topic=settings.log.topic,
        file_name=LOCAL_LOG_FILE,
        partitions=settings.log.partitions,
        transactional_id=settings.log.transactional_id,
    )


def open_dead_letters(settings: Settings) -> LogTransport:
    """A not-yet-started single-partition transport for the dead letters (topic
    ``log.dlq_topic`` on Kafka, ``dlq.sqlite3`` next to the embedded log)."""
    return _open_log(settings, topic=settings.log.dlq_topic, file_name="dlq.sqlite3", partitions=1)


def _open_log(
    settings: Settings,
    *,
    topic: str,
    file_name: str,
    partitions: int,
    transactional_id: str | None = None,
) -> LogTransport:
    log = settings.log
    if log.transport == "kafka":
        from .kafka_log import KafkaLogTransport

        return KafkaLogTransport(
            log.bootstrap,
            topic,
            partitions,
            request_timeout_s=log.request_timeout_s,
            transactional_id=transactional_id,
            replication_factor=log.replication_factor,
            min_insync_replicas=log.min_insync_replicas,
        )
    from .local_log import LocalLogTransport

    return LocalLogTransport(settings.data_path / file_name, partitions)


def open_vector_changelog(settings: Settings) -> KafkaChangelog | None:
    """The not-yet-started vector changelog (``<topic>.vectors``) on Kafka; ``None`` on the
    embedded local log, which keeps its vectors in the local cache only, or when disabled."""
    log = settings.log
    if log.transport != "kafka" or not log.vector_changelog:
        return None
    from .kafka_changelog import CHANGELOG_SUFFIX, KafkaChangelog

    return KafkaChangelog(
        log.bootstrap,
        log.topic + CHANGELOG_SUFFIX,
        log.partitions,
        request_timeout_s=log.request_timeout_s,
        replication_factor=log.replication_factor,
        min_insync_replicas=log.min_insync_replicas,
        configs=log.vector_changelog_configs,
    )


def open_key_store(settings: Settings) -> KeyStore:
    """The not-yet-started store of owners' data keys: ``keys.sqlite3`` next to the
    embedded log, or the compacted topic ``<topic>.keys`` on Kafka."""
    log = settings.log
    if log.transport == "kafka":
        from .kafka_changelog import KafkaChangelog
        from .kafka_keys import KEYS_SUFFIX, KEYS_TOPIC_CONFIGS, KafkaKeyStore

        topic = KafkaChangelog(
            log.bootstrap,
            log.topic + KEYS_SUFFIX,
            log.partitions,
            request_timeout_s=log.request_timeout_s,
            client_id="prme-keys",
            replication_factor=log.replication_factor,
            min_insync_replicas=log.min_insync_replicas,
            configs={**KEYS_TOPIC_CONFIGS, **log.keys_topic_configs},
        )
        return KafkaKeyStore(topic)
    from .keys import LocalKeyStore

    return LocalKeyStore(
        settings.data_path / "keys.sqlite3", log_path=settings.data_path / LOCAL_LOG_FILE
    )
