"""OpenAI's `strict: true` on a JSON schema (response_format.json_schema, a tool's function): the
output has exactly the properties the schema names. JSON Schema itself allows any others unless
`additionalProperties` says no, and a small model given that room invents keys; strict sets
`additionalProperties: false` on every object schema that does not set it, throughout (properties,
items, combinators, definitions)."""
import copy

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def strict_schema(schema: dict) -> dict:
    """A copy of `schema` with additionalProperties false on each object schema that leaves it open.
    """
    schema = copy.deepcopy(schema)
    _close(schema)
    return schema


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and
                                "object" in kind) or "properties" in schema


def _close(schema) -> None:
    if not isinstance(schema, dict):
        return
    if _is_object(schema) and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        for sub in (schema.get(key) or {}).values():
            _close(sub)
    for key in _SCHEMA_LISTS:
        for sub in schema.get(key) or []:
            _close(sub)
    for key in _SCHEMA_VALUES:
        _close(schema.get(key))
