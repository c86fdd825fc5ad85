"""A StructuredOutputsParams as the grammar llguidance compiles, and its checks, without a
tokenizer.

Kept apart from the engine's matchers (structured/matchers.py) because SamplingParams validates a
constraint at construction, before any engine or tokenizer exists: a bad schema, an unsupported
schema keyword, a regex that does not compile or a grammar with a syntax error is refused there, by
name, instead of failing a step later."""
import json

from vlinfer.structured.ecma_regex import ascii_classes, ascii_schema
from vlinfer.structured.json_bounds import bounded_numbers

JSON_SCHEMA_DRAFT = "https://json-schema.org/draft/2020-12/schema"


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # an optional dependency: the error names the extra that brings it
        raise ValueError(
            "structured outputs need the llguidance package (pip install 'vlinfer[structured]')"
        ) from e
    return llguidance


def schema_dict(schema, owner: str) -> dict:
    """A JSON schema given as a dict or a JSON string, as a dict; a string that is not JSON is
    refused by name."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{owner}.json is not valid JSON ({e})") from None
    # a valid JSON schema (true: anything, false: nothing) but no use as a constraint
    if isinstance(schema, bool):
        raise ValueError(f"{owner}.json must be a JSON schema object, got {schema!r}")
    if not isinstance(schema, dict):
        raise ValueError(
            f"{owner}.json must be a JSON schema (a dict or a JSON string), got "
            f"{type(schema).__name__}"
        )
    return schema


def check_json_schema(schema: dict, owner: str) -> None:
    """The schema against the JSON Schema meta-schema (its $schema draft, else 2020-12): a misspelt
    type or a `required` that is not a list is a schema error, said as jsonschema says it."""
    try:
        import jsonschema
    except ImportError:  # jsonschema is a test dependency; llguidance's own checks below still run
        return
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ValueError(
            f"{owner}.json is not a valid JSON schema at {where}: {e.message}") from None


def grammar_text(kind: str, value, disable_any_whitespace: bool = False,
                 owner: str = "StructuredOutputsParams") -> str:
    """The llguidance grammar (a JSON string) for one constraint; not yet fully checked (see
    check_grammar). A grammar llguidance cannot even translate (GBNF with a syntax error) is refused
    here, by name."""
    try:
        return _grammar_text(kind, value, disable_any_whitespace)
    except ValueError as e:
        raise ValueError(f"{owner}.{kind} is invalid or not supported: {e}") from None


def _grammar_text(kind: str, value, disable_any_whitespace: bool) -> str:
    matcher = _llguidance().LLMatcher
    if kind == "json":
        options = {"whitespace_flexible": False} if disable_any_whitespace else None
        return matcher.grammar_from_json_schema(ascii_schema(bounded_numbers(value)),
                                                overrides=options)
    if kind == "json_object":
        options = {"whitespace_flexible": False} if disable_any_whitespace else None
        return matcher.grammar_from_json_schema({"type": "object"}, overrides=options)
    if kind == "regex":
        return matcher.grammar_from_regex(ascii_classes(value))
    if kind == "choice":
        return _llguidance().grammar_from("choice", json.dumps(value))
    # Lark (llguidance's syntax) or GBNF (llama.cpp's and xgrammar's `root ::= ...`)
    if kind == "grammar":
        return _llguidance().grammar_from("grammar", value)
    raise ValueError(f"unknown structured output kind {kind!r}")


def check_grammar(grammar: str, kind: str, owner: str) -> None:
    """llguidance's own check without a tokenizer: regex syntax, grammar syntax and JSON schema
    keywords it does not implement (it refuses those rather than ignoring them, so a schema is never
    silently loosened)."""
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        message = messages[0] if messages else "rejected"
        raise ValueError(f"{owner}.{kind} is invalid or not supported: {message.strip()}")
