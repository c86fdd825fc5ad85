"""A request's structured-output constraint, vLLM's StructuredOutputsParams: checked when made
(tokenizer-free, with grammar_spec.py), compiled per engine by matchers.py."""
from dataclasses import dataclass, field

from vlinfer.structured import grammar_spec


@dataclass
class StructuredOutputsParams:
    """A constraint on what a request may generate, vLLM's names and meaning: exactly one of `json`
    (a JSON schema, a dict or a JSON string), `regex`, `choice` (the output is one of these
    strings), `grammar` (Lark or GBNF text) or `json_object=True` (any JSON object). Checked when
    made: a schema that is not valid, a schema keyword the backend (llguidance) does not implement,
    a regex or grammar that does not compile, an empty choice list, or no or two constraints raise a
    ValueError naming the problem. disable_any_whitespace: JSON without whitespace between tokens
    (vLLM's option); on by default here (vLLM's default is off), on every surface, because a small
    model given free whitespace pads JSON with newlines until max_tokens. Open integers and numbers
    are bounded (json_bounds.py)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    # which constraint is set: "json", "regex", "choice", ...
    kind: str = field(init=False, repr=False)
    # the llguidance grammar it compiles to
    grammar_text: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        owner = "StructuredOutputsParams"
        if self.json_object not in (None, True, False):
            raise ValueError(
                f"{owner}.json_object must be True, False or None, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"{owner}.disable_any_whitespace must be True or False, got "
                             f"{self.disable_any_whitespace!r}")
        chosen = [
            name for name in ("json", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        chosen += ["json_object"] if self.json_object else []
        if len(chosen) != 1:
            raise ValueError(
                f"{owner} takes exactly one of json, regex, choice, grammar, json_object; got " +
                (" and ".join(chosen) if chosen else "none"))
        self.kind = chosen[0]
        value = getattr(self, self.kind)
        if self.kind == "json":
            self.json = grammar_spec.schema_dict(self.json, owner)
            grammar_spec.check_json_schema(self.json, owner)
            value = self.json
        elif self.kind == "choice":
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(
                    f"{owner}.choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    f"{owner}.choice must hold non-empty strings only, got {self.choice!r}")
            self.choice = value = list(self.choice)
        elif self.kind in ("regex", "grammar") and (not isinstance(value, str) or not value):
            raise ValueError(f"{owner}.{self.kind} must be a non-empty string, got {value!r}")
        self.grammar_text = grammar_spec.grammar_text(self.kind, value, self.disable_any_whitespace,
                                                      owner)
        grammar_spec.check_grammar(self.grammar_text, self.kind, owner)

    @property
    def key(self) -> str:
        """What two equal constraints share (the engine's compile cache key)."""
        return self.grammar_text
