"""The pack's saved embedding configuration (``<data>/prme.json``).

Only identity metadata is saved: a custom provider's code, credentials and model files are
never serialized, so reopening a pack built with a custom provider needs that provider.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import msgspec

from prme.producers.factory import LOCAL_LOG_FILE
from prme.projectors.embeddings.fastembed_provider import FastEmbedProvider
from prme.projectors.embeddings.protocol import EmbeddingIdentity
from prme.schemas.config import LogSettings
from prme.schemas.errors import ConfigurationError

ProviderKind = Literal["fastembed", "custom"]
PACK_FILE = "prme.json"
PACK_MARKS = (PACK_FILE, "prme.lock", LOCAL_LOG_FILE, "keys.sqlite3", "shards")
"""Names a pack directory holds from its first moments (the lock is taken first)."""


def check_pack_directory(directory: Path) -> None:
    """ConfigurationError when ``directory`` holds files but nothing of a pack: opening it
    would scatter a pack's files among someone else's (a trial opened a source folder)."""
    try:
        # A mount point's lost+found, a .gitkeep or .DS_Store hold no one's files.
        entries = {
            entry.name
            for entry in os.scandir(directory)
            if not entry.name.startswith(".") and entry.name != "lost+found"
        }
    except (FileNotFoundError, NotADirectoryError):
        return  # made anew, or refused with its own error when it is made
    except OSError:
        return  # the lock's attempt names what is wrong with the directory
    if entries and not entries.intersection(PACK_MARKS):
        shown = ", ".join(sorted(entries)[:3]) + (", ..." if len(entries) > 3 else "")
        raise ConfigurationError(
            f"{directory} is not empty ({shown}) and holds no PRME pack: give a new or empty "
            "directory for a new pack, or the directory of an existing one"
        )


class EmbeddingConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The effective embedding configuration, decided by the provider's metadata."""

    provider: ProviderKind
    provider_class: str
    model_name: str
    model_version: str
    dimension: int

    @property
    def identity(self) -> EmbeddingIdentity:
        return EmbeddingIdentity(self.model_name, self.model_version, self.dimension)


class LogIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """The log a pack's read models were built from: the local log in the pack, or a Kafka
    topic (the brokers' addresses may change; a shard ahead of its partition's end shows a
    topic made anew, see ``ProjectorRunner``)."""

    transport: Literal["local", "kafka"]
    topic: str | None = None

    @classmethod
    def of(cls, log: LogSettings) -> LogIdentity:
        return cls(transport=log.transport, topic=log.topic if log.transport == "kafka" else None)

    def describe(self) -> str:
        return "the local log in the pack" if self.topic is None else f"Kafka topic {self.topic!r}"


class PackConfig(msgspec.Struct, frozen=True, kw_only=True):
    format: int = 1
    partitions: int
    embedding: EmbeddingConfig
    log: LogIdentity | None = None
    """``None`` in a pack made before it was saved (it is saved at the next open)."""


def check_log_identity(directory: Path, saved: PackConfig, log: LogSettings) -> PackConfig:
    """``saved`` with the log's identity (a pack without one takes ``log``'s); a pack built
    from another log is refused: its offsets mean nothing on this one, so its models would
    be served as they are and new writes skipped."""
    current = LogIdentity.of(log)
    if saved.log is None:
        return msgspec.structs.replace(saved, log=current)
    if saved.log != current:
        raise ConfigurationError(
            f"the pack in {directory} was built from {saved.log.describe()}, but these "
            f"settings read {current.describe()}: use another data directory for this log "
            "(a pack belongs to the log it was built from)"
        )
    return saved


def embedding_config_of(provider: object) -> EmbeddingConfig:
    inner = getattr(provider, "provider", provider)
    kind: ProviderKind = "fastembed" if type(inner) is FastEmbedProvider else "custom"
    cls = type(inner)
    return EmbeddingConfig(
        provider=kind,
        provider_class=f"{cls.__module__}.{cls.__qualname__}",
        model_name=provider.model_name,  # type: ignore[attr-defined]
        model_version=provider.model_version,  # type: ignore[attr-defined]
        dimension=provider.dimension,  # type: ignore[attr-defined]
    )


def remove_pack_config(directory: Path) -> None:
    """Forget the pack file written by a first start that failed."""
    (directory / PACK_FILE).unlink(missing_ok=True)


def load_pack_config(directory: Path) -> PackConfig | None:
    path = directory / PACK_FILE
    if not path.exists():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=PackConfig)
    except msgspec.MsgspecError as error:
        raise ConfigurationError(f"{path} is not a valid PRME pack config: {error}") from error


def save_pack_config(directory: Path, config: PackConfig) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / (PACK_FILE + ".tmp")
    temporary.write_bytes(msgspec.json.format(msgspec.json.encode(config)))
    os.replace(temporary, directory / PACK_FILE)
