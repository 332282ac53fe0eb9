"""Records and codecs: round trips, versions, unknown kinds, field-naming errors."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import msgspec
import pytest

from prme.schemas import records
from prme.schemas.codec import decode_record, encode_record, record_from_json, record_to_json
from prme.schemas.config import Settings
from prme.schemas.errors import (
    ConfigurationError,
    RecordDecodeError,
    UnknownRecordKind,
    UnsupportedRecordVersion,
)
from prme.schemas.records import (
    CONTROL_KINDS,
    KINDS,
    SCHEMA_VERSION,
    HistoryCleared,
    HistoryReplaced,
    Message,
    MessageDeleted,
    OwnerErased,
    message_text,
)

AT = datetime(2024, 5, 8, 13, 56, tzinfo=UTC)
ENVELOPE = {"event_id": "01a22b27-0000-7000-8000-000000000001", "owner": "alice", "recorded_at": AT}

EVERY_KIND = [
    Message(
        **ENVELOPE,
        role="tool",
        content=[{"type": "text", "text": "42"}, {"type": "image_url", "image_url": {"url": "x"}}],
        name="calculator",
        tool_call_id="call-1",
        tool_calls=[{"id": "call-1", "name": "add", "args": {"a": 1}}],
        message_id="lc-1",
        fields={"status": "success", "artifact": {"rows": [1, 2]}},
        metadata={"source": "test"},
        occurred_at=AT,
        request_id="req-1",
    ),
    HistoryCleared(**ENVELOPE, session_id="s1", scope="work"),
    MessageDeleted(**ENVELOPE, target_event_id="01a22b27-0000-7000-8000-000000000002"),
    HistoryReplaced(**ENVELOPE, message_count=2),
    records.NodeArchived(**ENVELOPE, node_id="mem:x", reason="stale"),
    records.NodeRestored(**ENVELOPE, node_id="mem:x"),
    records.NodeSuperseded(**ENVELOPE, node_id="mem:x", by_node_id="mem:y"),
    OwnerErased(**ENVELOPE),
]


@pytest.mark.parametrize("record", EVERY_KIND, ids=lambda r: type(r).__name__)
def test_every_kind_round_trips_through_msgpack_and_json(record: object) -> None:
    assert decode_record(encode_record(record)) == record  # type: ignore[arg-type]
    assert record_from_json(record_to_json(record)) == record  # type: ignore[arg-type]


def test_every_kind_is_covered_and_control_kinds_carry_no_content() -> None:
    assert {type(r).__struct_config__.tag for r in EVERY_KIND} == KINDS
    for record in EVERY_KIND:
        if type(record).__struct_config__.tag in CONTROL_KINDS:
            assert not hasattr(record, "content")


def test_a_newer_schema_version_is_refused_with_a_specific_error() -> None:
    newer = msgspec.msgpack.encode({**msgspec.to_builtins(EVERY_KIND[1]), "v": SCHEMA_VERSION + 1})
    with pytest.raises(UnsupportedRecordVersion, match="schema version 2"):
        decode_record(newer)


def test_an_unknown_kind_is_refused_with_a_specific_error() -> None:
    unknown = msgspec.msgpack.encode({**msgspec.to_builtins(EVERY_KIND[1]), "kind": "telepathy"})
    with pytest.raises(UnknownRecordKind, match="telepathy"):
        decode_record(unknown)
    with pytest.raises(UnknownRecordKind):
        record_from_json(msgspec.json.encode({"kind": "telepathy", "v": 1}))


def test_a_newer_writers_extra_fields_are_ignored() -> None:
    extended = {**msgspec.to_builtins(EVERY_KIND[1]), "future_field": [1, 2]}
    assert decode_record(msgspec.msgpack.encode(extended)) == EVERY_KIND[1]


def test_validation_errors_name_the_field() -> None:
    broken = {**msgspec.to_builtins(EVERY_KIND[0]), "owner": 7}
    with pytest.raises(RecordDecodeError, match=r"\$\.owner"):
        decode_record(msgspec.msgpack.encode(broken))
    with pytest.raises(RecordDecodeError, match="not msgpack"):
        decode_record(b"\xc1")


def test_message_text_joins_text_blocks_only() -> None:
    assert message_text("plain") == "plain"
    assert (
        message_text(
            [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}]
        )
        == "a\nb"
    )


def test_settings_come_from_prme_variables_with_nesting() -> None:
    settings = Settings.from_env(
        {
            "PRME_DATA_DIR": "/data",
            "PRME_LOG__TRANSPORT": "kafka",
            "PRME_LOG__PARTITIONS": "6",
            "PRME_SCORING__FUSION": "rrf",
            "PRME_SERVICE__API_KEYS": '{"k1": "alice"}',
            "HOME": "/ignored",
            "PRME_KAFKA_HEAP": "2g",
            "PRME_KAFKA_BOOTSTRAP": "127.0.0.1:9092",
        }
    )
    assert settings.data_dir == "/data" and settings.log.transport == "kafka"
    assert settings.log.partitions == 6 and settings.scoring.fusion == "rrf"
    assert settings.service.api_keys == {"k1": "alice"}


def test_unknown_or_invalid_settings_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="fusion"):
        Settings.from_env({"PRME_SCORING__FUSION": "magic"})
    with pytest.raises(ConfigurationError):
        Settings.from_env({"PRME_LOG__NO_SUCH_THING": "1"})


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("PRME_LOG_TRANSPORT", "PRME_LOG__TRANSPORT"),
        ("PRME_CLUSTER_SECRET", "PRME_CLUSTER__SECRET"),
        ("PRME_QUERY_CONSISTENCY_TIMEOUT_S", "PRME_QUERY__CONSISTENCY_TIMEOUT_S"),
        ("PRME_LOGS__TRANSPORT", None),
        ("PRME_DATADIR__X", None),
        # From an operations trial: these left a new pack in ./memory, exit 0.
        ("PRME_DATADIR", "PRME_DATA_DIR"),
        ("PRME_DATA_DIRS", "PRME_DATA_DIR"),
        ("PRME_MODEL_DIR", "PRME_MODELS_DIR"),
    ],
)
def test_a_misspelt_setting_is_refused_not_ignored(name: str, meant: str | None) -> None:
    """From a new-user trial: PRME_LOG_TRANSPORT=kafka (one underscore) and
    PRME_LOGS__TRANSPORT=kafka started a node on the embedded log without a word, outside
    the cluster it was meant for; a misspelt key inside a section was already refused."""
    with pytest.raises(ConfigurationError, match=name) as refused:
        Settings.from_env({name: "kafka"})
    if meant is not None:
        assert f"did you mean {meant}?" in str(refused.value)
    else:
        assert "sections:" in str(refused.value)


def test_the_toolings_variables_are_not_taken_for_misspelt_settings() -> None:
    tooling = ("KAFKA_BOOTSTRAP", "KAFKA_HEAP", "DATA_LOCK_TOKEN", "DATA_LOCK_HOLDER_FD", "PYTHON")
    assert Settings.from_env({f"PRME_{name}": "1" for name in tooling}) == Settings()


def test_an_empty_variable_is_no_value() -> None:
    """From an operations trial: PRME_API_KEY= (or PRME_LOG__TOPIC=) failed with "invalid
    JSON (Expecting value ...)": every string starts with ``""``."""
    empty = {"PRME_API_KEY": "", "PRME_LOG__TOPIC": "", "PRME_CLUSTER__SECRET": ""}
    assert Settings.from_env(empty) == Settings()


def test_an_object_setting_given_as_plain_text_says_it_takes_json() -> None:
    """From a new-user trial: PRME_SERVICE__API_KEYS='not json' said only "Expected
    `object`, got `str`"."""
    with pytest.raises(ConfigurationError, match="gives an object or a list as JSON"):
        Settings.from_env({"PRME_SERVICE__API_KEYS": "not json"})


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("PRME_EMBEDDING__QUERY_PRECISION", "fp16", "(one of: float, int8)"),
        ("PRME_SCORING__FUSION", "borda", "(one of: rrf, weighted, zscore)"),
        ("PRME_SCORING__WEIGHTS", '{"vectr": 1}', "(one of: graph, lexical, vector)"),
        ("PRME_LOG__TRANSPORT", "kafak", "(one of: kafka, local)"),
    ],
)
def test_a_value_outside_a_settings_choices_names_the_choices(
    variable: str, value: str, allowed: str
) -> None:
    """The message named the setting but not what it takes (the last stop's note)."""
    with pytest.raises(ConfigurationError) as raised:
        Settings.from_env({variable: value})
    assert allowed in str(raised.value)
    section, key = variable.removeprefix("PRME_").lower().split("__")
    with pytest.raises(ConfigurationError) as replaced:
        Settings().replace(**{section: {key: json.loads(value) if value[0] == "{" else value}})
    assert str(replaced.value).endswith(allowed)


def test_a_misspelt_key_in_a_section_says_what_it_is_close_to() -> None:
    """PRME_SCORING_FUSION got a suggestion, PRME_SCORING__FUSON did not (a trial)."""
    with pytest.raises(ConfigurationError) as raised:
        Settings.from_env({"PRME_SCORING__FUSON": "rrf"})
    assert "(did you mean PRME_SCORING__FUSION?)" in str(raised.value)
    with pytest.raises(ConfigurationError) as replaced:
        Settings().replace(query={"time_depht": 3})
    assert str(replaced.value).endswith("(did you mean time_depth?)")
    with pytest.raises(ConfigurationError) as unlike:
        Settings.from_env({"PRME_SCORING__XYZ": "1"})
    assert "did you mean" not in str(unlike.value)


@pytest.mark.parametrize(
    ("environ", "variable"),
    [
        ({"PRME_EMBEDDING__BATCH_SIZE": "-3"}, "PRME_EMBEDDING__BATCH_SIZE"),
        ({"PRME_SCORING__WEIGHTS": '{"vectr": 1}'}, "PRME_SCORING__WEIGHTS"),
        ({"PRME_CLUSTER__SECRET": " padded "}, "PRME_CLUSTER__SECRET"),
    ],
)
def test_a_settings_error_names_the_variable_that_set_it(
    environ: dict[str, str], variable: str
) -> None:
    """A new-user trial: the error named `$.embedding.batch_size`, the user had set
    PRME_EMBEDDING__BATCH_SIZE."""
    with pytest.raises(ConfigurationError) as raised:
        Settings.from_env(environ)
    assert str(raised.value).endswith(f"(set by {variable})")


def test_a_settings_error_from_an_override_names_no_variable() -> None:
    with pytest.raises(ConfigurationError) as overridden:
        Settings.from_env({"PRME_SCORING__FUSION": "rrf"}, embedding={"batch_size": -3})
    assert "set by" not in str(overridden.value)


def test_a_numeric_setting_out_of_range_gets_no_choices() -> None:
    with pytest.raises(ConfigurationError) as raised:
        Settings.from_env({"PRME_EMBEDDING__BATCH_SIZE": "-3"})
    assert "one of" not in str(raised.value)


def test_weights_and_timeouts_are_finite_and_zero_counts_stay_valid() -> None:
    """An infinite weight made every fused score nan (inf * 0); 0 standbys, a 0 weight
    and a 0 s consistency wait are meaningful and stay valid."""
    for name, value in (
        ("PRME_SCORING__WEIGHTS", '{"vector": 1e999}'),
        ("PRME_SCORING__WEIGHTS", '{"vector": -0.5}'),
        ("PRME_SCORING__WEIGHTS", '{"vectr": 1}'),  # a typo was ignored without a word
        ("PRME_CLUSTER__FORWARD_TIMEOUT_S", "0"),
        ("PRME_QDRANT__TIMEOUT_S", "nan"),
    ):
        with pytest.raises(ConfigurationError, match="invalid settings"):
            Settings.from_env({name: value})
    valid = Settings.from_env(
        {
            "PRME_CLUSTER__STANDBY_REPLICAS": "0",
            "PRME_SCORING__WEIGHTS": '{"vector": 0}',
            "PRME_QUERY__CONSISTENCY_TIMEOUT_S": "0",
            "PRME_QDRANT__TIMEOUT_S": "0.5",
        }
    )
    assert valid.cluster.standby_replicas == 0 and valid.query.consistency_timeout_s == 0
