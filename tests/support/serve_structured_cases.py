"""Builders and constants of tests/serve/test_serve_structured.py that other test modules use too
(json_object_prefix): imported from here by every one of them, that module included."""
import json

# What a JSON text cut short may still need (an open string's end, the rest of a literal or a
# number, a key's colon and value) before its open containers close: json_object_prefix tries each.
JSON_FILLERS = ["", '"', "0", ":0", '":0', '"a":0', 'n"', '0"', '00"', '000"', "e", "ue", "rue",
                "lse", "se", "alse", "ull", "ll", "l", "1"]


def json_object_prefix(text: str) -> bool:
    """Whether text is the start of a JSON object (RFC 8259): some completion parses as one. The
    test's own check, independent of the grammar engine that constrained it."""
    for filler in JSON_FILLERS:
        for then in ("", ":0", '"a":0', "0"):
            candidate = text + filler + then
            stack, in_string, escaped = [], False, False
            for char in candidate:
                if in_string:
                    escaped, in_string = (False, True) if escaped else (char == "\\",
                                                                        char != '"')
                elif char == '"':
                    in_string = True
                elif char in "{[":
                    stack.append("}" if char == "{" else "]")
                elif char in "}]" and stack:
                    stack.pop()
            if in_string:
                continue
            try:
                if isinstance(json.loads(candidate + "".join(reversed(stack))), dict):
                    return True
            except json.JSONDecodeError:
                pass
    return False
