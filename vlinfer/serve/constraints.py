"""A request's output constraint, from whichever field asks for one: OpenAI's `response_format`
(json_object, json_schema), vLLM's `structured_outputs` extra field, or a tool_choice that forces a
call ("required", a named function: the call object's JSON schema, see tool_calls.call_schema). At
most one may constrain a request; each problem is a 400 naming the field it came from, before
anything is queued."""
from vlinfer.sampling_params import StructuredOutputsParams
from vlinfer.serve.errors import ApiError
from vlinfer.serve.protocol import NamedToolChoice
from vlinfer.serve.tool_calls import call_schema, required_calls_grammar
from vlinfer.structured.grammar_spec import check_json_schema
from vlinfer.structured.strict_schema import strict_schema


def _build(param: str, **kwargs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise ApiError(400, f"{param}: {e}", param=param, code="invalid_value") from None
    except TypeError:  # a field StructuredOutputsParams does not have
        from dataclasses import fields
        known = sorted(f.name for f in fields(StructuredOutputsParams) if f.init)
        unknown = sorted(set(kwargs) - set(known))
        raise ApiError(400, f"{param} has no field(s) {unknown}; it takes {known}", param=param,
                       code="invalid_value") from None


def forced_tool(req) -> str | None:
    """"*" when tool_choice is "required", the function's name when it names one, else None."""
    choice = getattr(req, "tool_choice", None)
    if isinstance(choice, NamedToolChoice):
        return choice.function.name
    return "*" if choice == "required" else None


def output_constraint(
    req, disable_any_whitespace: bool = False, tag_ids: tuple[int | None, int | None] = (None, None)
) -> StructuredOutputsParams | None:
    """disable_any_whitespace: the server's default (vLLM's --structured-outputs-config option); a
    request's own structured_outputs.disable_any_whitespace wins. tag_ids: the tool-call tags' token
    ids (tag_token_ids)."""
    fmt = req.response_format
    asked = [name for name, on in (("response_format", fmt is not None and fmt.type != "text"),
                                   ("structured_outputs", req.structured_outputs is not None),
                                   ("tool_choice", forced_tool(req) is not None)) if on]
    if len(asked) > 1:
        raise ApiError(400, f"{' and '.join(asked)} both constrain the output; send one of them",
                       param=asked[1], code="invalid_value")
    if not asked:
        return None
    if asked[0] == "response_format":
        if fmt.type == "json_object":
            return _build("response_format", json_object=True,
                          disable_any_whitespace=disable_any_whitespace)
        schema = fmt.json_schema.schema_
        return _build("response_format.json_schema.schema",
                      disable_any_whitespace=disable_any_whitespace,
                      json=strict_schema(schema) if fmt.json_schema.strict else schema)
    if asked[0] == "structured_outputs":
        return _build("structured_outputs", **{"disable_any_whitespace": disable_any_whitespace,
                                               **req.structured_outputs})
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    for tool in tools:  # a function marked strict gets exactly the arguments its schema names
        function = tool["function"]
        if function.get("strict") and function.get("parameters") is not None:
            function["parameters"] = strict_schema(function["parameters"])
    name = forced_tool(req)
    if name == "*":
        try:  # the tools' schemas, said as for a json constraint, before they go into the grammar
            check_json_schema(call_schema(tools), "tools")
        except ValueError as e:
            raise ApiError(400, f"tools: {e}", param="tools", code="invalid_value") from None
        parallel = req.parallel_tool_calls is not False
        return _build(
            "tools", grammar=required_calls_grammar(tools, parallel, disable_any_whitespace,
                                                    tag_ids))
    return _build("tools", json=call_schema(tools, name),
                  disable_any_whitespace=disable_any_whitespace)
