"""Tool calls: `tools`, `tool_choice`, assistant `tool_calls` and `tool` messages -> a prompt the
model reads and, for a forced choice, a grammar its answer follows; the answer -> `tool_calls`.

1. `parse_tools(body)` checks `tools` (functions: a name, a description, a JSON schema of
   parameters), `tool_choice` (`none`, `auto`, `required`, or one named function) and
   `parallel_tool_calls`; None when the request offers no tools or chooses `none`.
2. `tool_messages(messages, tools)` renders the conversation in Gemma 3's prompted function
   calling (its template has no tool role and the model no tool token): the instruction and
   the functions' JSON definitions open the system turn (the template puts it before the
   first user text), an assistant's `tool_calls` become its turn's text (one JSON object per
   call), and `tool` results become user turns naming the function they answer.
3. A call is Gemma's JSON form `{"name": ..., "parameters": {...}}`. With `required` or a named
   function, `constraint` makes decoding follow that shape (the parameters follow the
   function's schema); with `auto` the model may answer either way.
4. `calls_in(text, tools)` reads an answer: the call(s) it makes (`arguments` is read as
   `parameters` too), or None for plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from daemon.errors import bad_request
from engine.types import Constraint

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128
INSTRUCTIONS = ("You have access to functions. If you decide to invoke any of the function(s), you MUST put "
                "it "
                'in the format of {"name": function name, "parameters": dictionary of argument name and its '
                "value}\nYou SHOULD NOT include any other text in the response if you call a function")
"""Gemma 3's documented instruction for prompted function calling, in its JSON form."""


@dataclass(frozen=True)
class Tools:
    functions: dict[str, dict[str, Any]]
    """name -> {"name", "description", "parameters"} of each function offered."""
    choice: str
    """"auto", "required", or the one function's name that must be called."""

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def constraint(self) -> Constraint | None:
        """The grammar of a forced call: a call of the named function, or of any offered one."""
        if not self.forced:
            return None
        names = list(self.functions) if self.choice == "required" else [self.choice]
        shapes = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                   "properties": {"name": {"const": n}, "parameters": self.functions[n]["parameters"]}}
                  for n in names]
        schema = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        return Constraint("json", json.dumps(schema), "tool_choice" if self.choice != "required" else "tools")

    def system_text(self) -> str:
        return INSTRUCTIONS + "\n" + json.dumps(list(self.functions.values()), indent=2)


def parse_tools(body: dict[str, Any]) -> Tools | None:
    """The request's tools and choice, checked (400 naming the field); None without tools or
    with `tool_choice: "none"`."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls", "invalid_type")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice", "invalid_value")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise bad_request(f"tools must be an array of at most {MAX_TOOLS} functions", "tools", "invalid_type")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        functions.update([_function(tool, f"tools[{i}]", functions)])
    if choice in (None, "auto"):
        return Tools(functions, "auto")
    if choice == "none":
        return None
    if choice == "required":
        return Tools(functions, "required")
    if isinstance(choice,
                  dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if set(choice) - {"type", "function"} or set(choice["function"]) - {"name"}:
            raise bad_request("tool_choice has unknown keys", "tool_choice", "invalid_value")
        if name not in functions:
            raise bad_request(f"tool_choice names {str(name)[:80]!r}, which is not among tools",
                              "tool_choice", "invalid_value")
        return Tools(functions, name)
    raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                      '{"name": ...}}', "tool_choice", "invalid_value")


def _function(tool: Any, param: str, seen: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if not isinstance(tool,
                      dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f'{param} must be {{"type": "function", "function": {{...}}}}', param,
                          "invalid_value")
    if set(tool) - {"type", "function"}:
        raise bad_request(f"{param} has unknown keys {sorted(set(tool) - {'type', 'function'})}", param,
                          "invalid_value")
    fn = tool["function"]
    unknown = set(fn) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise bad_request(f"{param}.function has unknown keys {sorted(unknown)}", f"{param}.function",
                          "invalid_value")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise bad_request(f"{param}.function.name must be 1-64 letters, digits, _ or -",
                          f"{param}.function.name",
                          "invalid_value")
    if name in seen:
        raise bad_request(f"{param}.function.name {name!r} is offered twice", f"{param}.function.name",
                          "invalid_value")
    description = fn.get("description", "")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(description, str):
        raise bad_request(f"{param}.function.description must be a string", f"{param}.function.description",
                          "invalid_type")
    if not isinstance(parameters, dict):
        raise bad_request(f"{param}.function.parameters must be a JSON schema object",
                          f"{param}.function.parameters", "invalid_type")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad_request(f"{param}.function.strict must be a boolean", f"{param}.function.strict",
                          "invalid_type")
    return name, {"name": name, "description": description, "parameters": parameters}


def tool_messages(messages: list[dict[str, Any]], tools: Tools | None) -> list[dict[str, Any]]:
    """`messages` (checked: role, content, `tool_calls`, `tool_call_id`) as plain system, user and
    assistant turns: the tools' instructions first, calls as their JSON, results as user turns
    (consecutive user turns joined)."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for m in messages:
        role, text = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            for call in m["tool_calls"]:
                names[call["id"]] = call["name"]
            calls = "\n".join(json.dumps({"name": c["name"], "parameters": c["arguments"]})
                              for c in m["tool_calls"])
            text = (text + "\n" if text else "") + calls
        elif role == "tool":
            role, text = "user", f"Function {names.get(m.get('tool_call_id', ''), 'call')} returned: {text}"
        if out and role == "user" and out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + text}
        else:
            out.append({"role": role, "content": text})
    if tools is not None:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": tools.system_text() + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": tools.system_text()})
    return out


def check_tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`: [{"id", "name", "arguments" (parsed)}]; 400 naming
    the field otherwise."""
    if not isinstance(calls, list) or not calls:
        raise bad_request(f"{param} must be a non-empty array", param, "invalid_type")
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and call.get("type", "function") == "function"
                and isinstance(call.get("id"), str)
                and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise bad_request(f'{where} must be {{"id", "type": "function", "function": {{"name", '
                              f'"arguments"}}}}', where, "invalid_value")
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError:
            raise bad_request(f"{where}.function.arguments is not JSON", f"{where}.function.arguments",
                              "invalid_value") from None
        out.append({"id": call["id"], "name": fn["name"], "arguments": arguments})
    return out


def calls_in(text: str, tools: Tools) -> list[dict[str, Any]] | None:
    """The tool calls an answer makes (OpenAI's shape, arguments as JSON text), or None when it is
    plain content: one JSON object per line, each naming an offered function."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    calls = []
    for line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in tools.functions:
            return None
        args = obj.get("parameters", obj.get("arguments"))  # Gemma's key, or OpenAI's
        if not isinstance(args, dict):
            return None
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args)}})
    return calls or None
