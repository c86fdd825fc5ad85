"""A POST route's body read into its request model (serve/protocol.py): JSON only, a JSON object,
strictly typed, with what the model cannot serve refused by name; every failure one 400 that names
the field."""
import json
from typing import Any

from pydantic import BaseModel, ValidationError

from vlinfer.serve.errors import ApiError

# pydantic's labels of union members in an error's location: left out of the field's name
_UNION_LABELS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "ImagePart",
                 "NamedToolChoice", "ScoreMultiModal"}


def _clean_loc(loc) -> str:
    """('messages', 0, 'content', 'list[tagged-union[...]]', 1) -> 'messages.0.content.1'"""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _UNION_LABELS or "[" in p))]
    return ".".join(parts)


def validation_error(e: ValidationError) -> ApiError:
    errors = e.errors(include_url=False)
    # our validators' own words (value_error) over the noise of the union members they sit in
    errors = [err for err in errors if err["type"] == "value_error"] or errors
    errors = sorted(errors, key=lambda err: -len(_clean_loc(err["loc"])))
    seen, lines = set(), []
    for err in errors:
        line = f"{_clean_loc(err['loc']) or 'body'}: {err['msg']}"
        if line not in seen:
            seen.add(line)
            lines.append(line)
    more = f" (and {len(lines) - 3} more)" if len(lines) > 3 else ""
    return ApiError(400, f"invalid request: {'; '.join(lines[:3])}{more}",
                    param=_clean_loc(errors[0]["loc"]) or None, code="invalid_value")


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8", code="invalid_json") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}",
                       code="invalid_json") from None
    except RecursionError:  # nesting deep enough to exhaust the parser's stack
        raise ApiError(400, "the request body is not valid JSON: nested too deeply",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    try:
        request = model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply", code="invalid_json") from None
    problem = request.unsupported()
    if problem:
        raise ApiError(400, problem[1], param=problem[0], code="unsupported")
    return request


async def read_json(request, model: type[BaseModel]) -> Any:
    """The request's body (Content-Type application/json, nothing else) parsed into `model`."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                       code="unsupported_media_type")
    return parse_body(model, await request.body())
