"""Numbers a JSON parser can read: a JSON schema's integer or number left open on a side gets the
bound of the exactly representable integers (2**53 - 1, RFC 8259's interoperable range; 16 digits),
so a model cannot write digits until max_tokens. A bound the schema gives is kept. Why a lone
`maximum` did not stop runaway digits before: it bounds only one side, and every negative integer,
however long, is below it. Fractions stay open (llguidance has no digit limit for them)."""
import copy

# the largest integer every JSON parser reads exactly (an IEEE double's 53-bit mantissa)
JSON_SAFE_INTEGER = 2 ** 53 - 1
_SKIP = ("enum", "const", "default", "examples")


def bounded_numbers(schema):
    """A copy of a JSON schema whose integer and number schemas are bounded on both sides."""
    schema = copy.deepcopy(schema)
    _bound(schema)
    return schema


def _is_numeric(node: dict) -> bool:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    return "integer" in kinds or "number" in kinds


def _bound(node) -> None:
    if isinstance(node, list):
        for item in node:
            _bound(item)
        return
    if not isinstance(node, dict):
        return
    if _is_numeric(node):
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = JSON_SAFE_INTEGER
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = -JSON_SAFE_INTEGER
    for key, value in node.items():
        if key not in _SKIP and key != "properties":
            _bound(value)
        elif key == "properties" and isinstance(value, dict):
            for sub in value.values():  # property names are not schemas
                _bound(sub)
