"""Regex classes as ECMA-262 means them (JSON Schema's `pattern` dialect, xgrammar's and most vLLM
users' assumption): `\\d` is [0-9] and `\\w` is [A-Za-z0-9_], with `\\D` and `\\W` their
complements. llguidance reads them the Unicode way (`\\d` is any Unicode digit), which lets a model
write U+1FBF8 SEGMENTED DIGIT EIGHT where a date was asked for, so every regex and schema pattern is
rewritten to the ASCII classes before it is compiled. `\\s` keeps its meaning (ECMA-262's `\\s` is
Unicode whitespace too)."""
import copy

ASCII_CLASSES = {"d": "0-9", "w": "A-Za-z0-9_"}


def ascii_classes(regex: str) -> str:
    """The same regex with \\d \\D \\w \\W spelt as ASCII classes, inside character classes too."""
    out, i, depth = [], 0, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            name = escaped.lower()
            if name in ASCII_CLASSES:
                body = ASCII_CLASSES[name]
                if escaped.islower():
                    out.append(body if depth else f"[{body}]")
                else:
                    out.append(f"[^{body}]")  # nested inside a class: regex-syntax's class union
            else:
                out.append(regex[i:i + 2])
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def ascii_schema(schema):
    """A copy of a JSON schema with every `pattern` and `patternProperties` key rewritten by
    ascii_classes."""
    schema = copy.deepcopy(schema)
    _rewrite(schema)
    return schema


def _rewrite(node) -> None:
    if isinstance(node, list):
        for item in node:
            _rewrite(item)
        return
    if not isinstance(node, dict):
        return
    for key, value in list(node.items()):
        if key == "pattern" and isinstance(value, str):
            node[key] = ascii_classes(value)
        elif key == "patternProperties" and isinstance(value, dict):
            node[key] = {ascii_classes(k): v for k, v in value.items()}
            _rewrite(node[key])
        elif key not in ("enum", "const", "default", "examples"):
            _rewrite(value)
