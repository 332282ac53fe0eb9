"""The OpenAPI document of the HTTP service: the error responses every protected route
documents and a schema plugin that states the rules the service enforces on bodies
(``tests/test_schemathesis.py`` holds the service to it)."""

from __future__ import annotations

from litestar._openapi.schema_generation import SchemaCreator
from litestar._openapi.schema_generation.plugins.struct import StructSchemaPlugin
from litestar.openapi import ResponseSpec
from litestar.openapi.spec import Reference, Schema
from litestar.openapi.spec.enums import OpenAPIType
from litestar.typing import FieldDefinition

from prme.producers.producer import NUMBER_RANGE
from prme.schemas.records import VISIBLE_TEXT_PATTERN

from .http_types import Body, ErrorBody, HistoryMessageIn

ERROR_DESCRIPTIONS: dict[int, str] = {
    400: "invalid_input: malformed JSON, a missing or unknown field or query parameter, a wrong "
    "type or a bad value (the detail names the field); nothing was written",
    401: "unauthenticated: no API key, or an unknown one",
    403: "forbidden: the key may not act for that owner",
    404: "not_found: no such event or node for the owner, or no such route",
    409: "request_id_conflict: the owner already used the request_id for a write with other "
    "content (nothing was written); embedding_mismatch: the pack's vectors were built by "
    "another embedding provider",
    413: "payload_too_large: the body is over limits.max_body_bytes",
    503: "shard_unavailable / transport_unavailable: the owner is not projected by this "
    "process, the projector stopped, or the log is unreachable (with Retry-After, unless "
    "the body lists what was written); not_ready: the node is starting and did nothing",
    504: "consistency_timeout: a write or the after token was not applied within "
    "query.consistency_timeout_s; append_unconfirmed: the log did not confirm the write in "
    "time and may still take it (retry with the same request_id)",
}


def error_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """The documented error responses ``statuses``: all of them an :class:`ErrorBody`."""
    return {
        status: ResponseSpec(
            ErrorBody, description=ERROR_DESCRIPTIONS[status], generate_examples=False
        )
        for status in statuses
    }


PROTECTED_ERRORS = error_responses(400, 401, 403, 404, 409, 413, 503, 504)
"""What every route behind an API key can answer besides its success."""


class JsonValue:
    """Marks the component schema of free-form JSON in the OpenAPI document."""


def json_value_schema(schema_creator: SchemaCreator) -> Reference:
    """A reference to the ``JsonValue`` component (registered on first use): free-form JSON
    whose numbers lie in ``NUMBER_RANGE``, what the producer's ``check_numbers`` accepts."""
    registry = schema_creator.schema_registry
    marker = FieldDefinition.from_annotation(JsonValue)
    schema = registry.get_schema_for_field_definition(marker)

    def ref() -> Reference:
        reference = registry.get_reference_for_field_definition(marker)
        assert reference is not None
        return reference

    if schema.any_of is None:
        schema.title = "JsonValue"
        schema.description = (
            "Free-form JSON (metadata, fields, tool calls, content blocks); every number lies "
            "between -2**63 and 2**64-1, what the log's msgpack stores"
        )
        schema.any_of = [
            Schema(type=OpenAPIType.STRING),
            Schema(type=OpenAPIType.BOOLEAN),
            Schema(type=OpenAPIType.NULL),
            Schema(type=OpenAPIType.NUMBER, minimum=NUMBER_RANGE[0], maximum=NUMBER_RANGE[1]),
            Schema(type=OpenAPIType.ARRAY, items=ref()),
            Schema(type=OpenAPIType.OBJECT, additional_properties=ref()),
        ]
    return ref()


class StrictBodySchemaPlugin(StructSchemaPlugin):
    """Request bodies in the OpenAPI document as the service decodes them: unknown fields
    are refused (``additionalProperties: false``), and a message's content shows something
    (visible text, or a block of another type) unless it carries tool calls or fields (the
    rule ``check_content`` applies)."""

    def is_plugin_supported_field(self, field_definition: FieldDefinition) -> bool:
        return not field_definition.is_union and field_definition.is_subclass_of(Body)

    def to_openapi_schema(
        self, field_definition: FieldDefinition, schema_creator: SchemaCreator
    ) -> Schema:
        schema = super().to_openapi_schema(field_definition, schema_creator)
        schema.additional_properties = False
        if field_definition.is_subclass_of(HistoryMessageIn):
            properties = dict(schema.properties or {})
            value = json_value_schema(schema_creator)
            value_object = Schema(type=OpenAPIType.OBJECT, additional_properties=value)
            properties["content"] = Schema(
                one_of=[
                    Schema(type=OpenAPIType.STRING),
                    Schema(type=OpenAPIType.ARRAY, items=value_object),
                ]
            )
            properties["tool_calls"] = Schema(type=OpenAPIType.ARRAY, items=value_object)
            properties["metadata"] = properties["fields"] = value_object
            schema.properties = properties
            text = Schema(type=OpenAPIType.STRING, min_length=1, pattern=VISIBLE_TEXT_PATTERN)
            shown_block = Schema(
                type=OpenAPIType.OBJECT,
                any_of=[
                    Schema(  # an image, a file: no text needed
                        required=["type"],
                        properties={"type": Schema(schema_not=Schema(enum=[None, "text"]))},
                    ),
                    Schema(
                        required=["type", "text"],
                        properties={"type": Schema(const="text"), "text": text},
                    ),
                ],
            )
            blocks = Schema(type=OpenAPIType.ARRAY, min_items=1, contains=shown_block)
            calls = Schema(type=OpenAPIType.ARRAY, min_items=1)
            schema.any_of = [
                Schema(properties={"content": Schema(one_of=[text, blocks])}),
                Schema(required=["tool_calls"], properties={"tool_calls": calls}),
                Schema(
                    required=["fields"],
                    properties={"fields": Schema(type=OpenAPIType.OBJECT, min_properties=1)},
                ),
            ]
        return schema
