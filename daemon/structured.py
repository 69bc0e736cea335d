"""Structured outputs: a request body's constraint -> `engine.types.Constraint`, checked.

Spellings read (at most one per request):
- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}` (any JSON
  object), `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's extras: `guided_json` (a schema, object or text), `guided_regex`, `guided_choice` (a
  list of strings), `guided_grammar` (Lark or GBNF), and `structured_outputs` holding one of
  `json`, `regex`, `choice`, `grammar` (vLLM's newer spelling).
The constraint is compiled once here (engine.grammar.grammar_text), so a schema, regex or grammar
that cannot be compiled is a 400 naming the field before the request reaches the engine.
"""

from __future__ import annotations

import json
from typing import Any

from daemon.errors import bad_request
from engine.grammar import ConstraintError, grammar_text
from engine.types import Constraint

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
"""vLLM's request extras -> constraint kinds."""
STRUCTURED = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
"""The keys of vLLM's `structured_outputs` object -> constraint kinds."""
FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED})
"""Body keys this module reads."""
ANY_OBJECT = '{"type": "object"}'
MAX_SPEC_CHARS = 100_000
"""Longest schema, regex or grammar text a request may carry."""


def constraint_of(body: dict[str, Any]) -> Constraint | None:
    """The body's constraint, compiled and checked; None when it has none. 400 naming the field
    for a malformed one, for one that cannot be compiled, or for two at once."""
    found = [c for c in (_response_format(body.get("response_format")), *_extras(body)) if c is not None]
    if len(found) > 1:
        raise bad_request(f"{found[0].param} and {found[1].param} both constrain the output; send one",
                          found[1].param, "invalid_value")
    if not found:
        return None
    c = found[0]
    if len(c.spec) > MAX_SPEC_CHARS:
        raise bad_request(f"{c.param} is {len(c.spec)} characters; at most {MAX_SPEC_CHARS}", c.param,
                          "invalid_value")
    try:
        grammar_text(c)
    except ConstraintError as exc:
        raise bad_request(str(exc), exc.field, exc.code) from None
    return c


def _response_format(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a string `type`", "response_format",
                          "invalid_type")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra or (kind != "json_schema" and "json_schema" in value):
        raise bad_request(f"response_format has unknown keys {sorted(extra or {'json_schema'})}",
                          "response_format", "invalid_value")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json", ANY_OBJECT, "response_format")
    if kind != "json_schema":
        raise bad_request(("response_format.type must be text, json_object or json_schema, "
                           f"got {kind!r}")[:300], "response_format.type", "invalid_value")
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(f"{param} must be an object with a `name` and a `schema`", param, "invalid_type")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise bad_request(f"{param} has unknown keys {sorted(unknown)}", param, "invalid_value")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request(f"{param}.name must be a non-empty string", f"{param}.name", "invalid_value")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request(f"{param}.strict must be a boolean", f"{param}.strict", "invalid_type")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise bad_request(f"{param}.schema must be a JSON schema object", f"{param}.schema", "invalid_type")
    # strict or not, the output follows the schema: constrained decoding has no weaker mode
    return Constraint("json", json.dumps(schema), f"{param}.schema")


def _extras(body: dict[str, Any]) -> list[Constraint | None]:
    out: list[Constraint | None] = [_extra(key, kind, body.get(key)) for key, kind in GUIDED.items()]
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs", "invalid_type")
        keys = [k for k, v in structured.items() if v is not None]
        unknown = set(keys) - set(STRUCTURED)
        if unknown or len(keys) != 1:
            raise bad_request(f"structured_outputs must hold exactly one of {sorted(STRUCTURED)}, got "
                              f"{sorted(keys)}"[:300], "structured_outputs", "invalid_value")
        key = keys[0]
        out.append(_extra(f"structured_outputs.{key}", STRUCTURED[key], structured[key]))
    return out


def _extra(param: str, kind: str, value: Any) -> Constraint | None:
    if value is None:
        return None
    if kind == "json":
        if isinstance(value, str):
            return Constraint("json", value, param)
        if not isinstance(value, dict):
            raise bad_request(f"{param} must be a JSON schema (an object or its text)", param, "invalid_type")
        return Constraint("json", json.dumps(value), param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
            raise bad_request(f"{param} must be a non-empty list of non-empty strings", param,
                              "invalid_value")
        return Constraint("choice", json.dumps(value), param)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param, "invalid_type")
    return Constraint(kind, value, param)
