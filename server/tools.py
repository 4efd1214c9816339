"""Tool calling: validate `tools` / `tool_choice` / `parallel_tool_calls`, put the tools into the
prompt, constrain the output when a call is required, and pick the parser of the output.

| tool_choice          | prompt          | generation                              | parser            |
| -------------------- | --------------- | --------------------------------------- | ----------------- |
| "none"               | no tools        | free                                    | none (content)    |
| "auto" (default)     | tools           | free; a call: its tool's schema         | HermesStreamer    |
| "required"           | tools           | JSON schema: array of {name, arguments} | CallArrayStreamer |
| {"function": {name}} | tools           | JSON schema: that function's parameters | NamedCallStreamer |

The arguments always parse and match the function's `parameters` schema (the grammar enforces
it; with "auto" from the moment the model writes `<tool_call>`, through a lazily triggered
XGrammar structural tag), except where `max_tokens` cuts the call, and for a function that
says `"strict": false` (then any JSON object, as OpenAI reads it). Every tool's `parameters`
must be a valid, satisfiable JSON schema under any tool_choice (`check_tool_constraint`).

Tools reach the model through the chat template (`apply_chat_template(tools=...)`) when the
template uses them; otherwise (SmolLM2's template ignores tools) a Hermes-style system prompt
lists them, assistant `tool_calls` are written back as `<tool_call>` blocks and `tool` messages
as `<tool_response>` blocks, so a conversation round-trips through any template.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.structured import GrammarError, check_valid
from deepinfer.server.errors import APIError, spelled
from deepinfer.server.protocol import ChatCompletionRequest
from deepinfer.server.structured import invalid_constraint
from deepinfer.server.tool_parser import (TOOL_CALL_END, TOOL_CALL_START, CallArrayStreamer,
                                HermesStreamer, NamedCallStreamer, ToolCallStreamer)

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

HERMES_SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions. Here are the "
    "available tools: <tools>{tools}</tools>\nFor each function call return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


@dataclass
class ToolConfig:
    """tools: the validated `tools` list (OpenAI shape); choice: "none" | "auto" | "required" |
    "named"; name: the function for "named"; parallel: several calls allowed."""

    tools: list[dict[str, Any]]
    choice: str
    name: str | None
    parallel: bool

    def parameters(self, name: str) -> dict[str, Any]:
        """The schema the grammar holds the function's arguments to: its `parameters`, any
        JSON object when the function says `"strict": false` (OpenAI's meaning: no schema
        enforcement), an empty object when it has no parameters (as OpenAI reads it)."""
        for tool in self.tools:
            if tool["function"]["name"] == name:
                if tool["function"].get("strict") is False:
                    return {"type": "object"}
                return (tool["function"].get("parameters")
                        or {"type": "object", "properties": {}, "additionalProperties": False})
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]


_FUNCTION_FIELD_TYPES = {"description": (str, "a string"), "strict": (bool, "true or false")}


def _check_tools(tools: list[Any]) -> None:
    """The tools' shapes (cheap, on the event loop); `check_tool_constraint` checks their
    schemas."""
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise APIError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}; "
                           "only function tools are supported.", param=where,
                           code="invalid_value")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(f"{where}.function must be an object with at least a \"name\", got "
                           f"{spelled(function)}; send {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ...}}}}.", param=f"{where}.function",
                           code="invalid_type")
        if not _NAME.match(str(function.get("name", ""))):
            raise APIError(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'.",
                           param=f"{where}.function.name", code="invalid_value")
        for field, (kind, expected) in _FUNCTION_FIELD_TYPES.items():
            value = function.get(field)
            if value is not None and not isinstance(value, kind):
                raise APIError(f"{where}.function.{field} must be {expected}, got "
                               f"{spelled(value)}; send {expected} or omit it.",
                               param=f"{where}.function.{field}",
                               code="invalid_type")
        parameters = function.get("parameters")
        if parameters is not None and (not isinstance(parameters, dict)
                                       or parameters.get("type", "object") != "object"):
            raise APIError(f"{where}.function.parameters must be a JSON schema of type "
                           "'object' (the arguments are a JSON object), e.g. {\"type\": "
                           "\"object\", \"properties\": {...}}.",
                           param=f"{where}.function.parameters", code="invalid_value")
    names = [tool["function"]["name"] for tool in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(f"tools[{i}].function.name {spelled(name)} repeats an earlier "
                           "tool's name; give each function a unique name.",
                           param=f"tools[{i}].function.name", code="invalid_value")


def tool_config(req: ChatCompletionRequest) -> ToolConfig | None:
    """The request's tool settings, or None when it offers no tools.

    Raises:
        APIError: 400 for malformed tools, an unknown tool_choice, or a named function that
            is not among the tools.
    """
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(f"tool_choice={spelled(choice)} needs tools; send tools or drop "
                           "tool_choice.", param="tool_choice", code="invalid_value")
        return None
    _check_tools(tools)
    names = [tool["function"]["name"] for tool in tools]
    parallel = req.parallel_tool_calls is not False
    if choice is None or choice in ("none", "auto", "required"):
        return ToolConfig(tools, choice or "auto", None, parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name is None:
        raise APIError(f"tool_choice={spelled(choice)} must be \"none\", \"auto\", \"required\" or "
                       "{\"type\": \"function\", \"function\": {\"name\": ...}}.",
                       param="tool_choice", code="invalid_value")
    if name not in names:
        raise APIError(f"tool_choice names function {spelled(name)}, which is not in tools "
                       f"({', '.join(names)}).", param="tool_choice", code="invalid_value")
    return ToolConfig(tools, "named", name, parallel)


def _held_tools(config: ToolConfig, so_args: dict[str, Any] | None) -> list[int]:
    """Indices of the tools whose own `parameters` the tool constraint `so_args`
    (`tool_so_args`) holds the output to, as they are: every one under "required", the named
    one under a named choice; not a `"strict": false` tool's nor a missing `parameters`."""
    if so_args is None or config.choice not in ("required", "named"):
        return []
    return [i for i, tool in enumerate(config.tools)
            if tool["function"].get("parameters") is not None
            and tool["function"].get("strict") is not False
            and (config.choice == "required" or tool["function"]["name"] == config.name)]


def _check_schemas(config: ToolConfig, indices: list[int]) -> None:
    for i in indices:
        try:
            check_valid(config.tools[i]["function"]["parameters"])
        except GrammarError as exc:
            raise invalid_constraint(exc, f"tools[{i}].function.parameters") from None


async def check_tool_constraint(engine: Any, config: ToolConfig | None,
                                so_args: dict[str, Any] | None) -> None:
    """Check every tool's `parameters` (`check_valid`: a valid, satisfiable JSON schema, under
    any tool_choice, as OpenAI checks) and compile the tool constraint `so_args`
    (`tool_so_args`; None: the output is free) through the engine, each schema checked once
    per request: the engine's compile checks those `so_args` holds the output to as they are
    (its first check is `check_valid`), the others are checked here, in a worker thread
    (`check_valid` caches its verdicts, but a first check of a large schema took 0.49 s,
    which every stream would have waited for on the event loop).

    Raises:
        APIError: 400 naming `tools[i].function.parameters` of the refused schema; "tools"
            when the engine refuses the constraint for a reason no tool's schema alone gives.
    """
    if config is None:
        return
    held = _held_tools(config, so_args)
    others = [i for i, tool in enumerate(config.tools)
              if tool["function"].get("parameters") is not None and i not in held]
    await asyncio.to_thread(_check_schemas, config, others)
    if so_args is None:
        return
    try:
        await engine.compile_grammar(so_args)
    except ValueError as exc:
        if config.choice == "named" and held:    # the constraint is that one schema
            raise invalid_constraint(exc, f"tools[{held[0]}].function.parameters") from None
        # "required": which tool's schema, if one alone is invalid (only once refused)
        await asyncio.to_thread(_check_schemas, config, held)
        raise invalid_constraint(exc, "tools") from None


def tool_so_args(config: ToolConfig | None) -> dict[str, Any] | None:
    """The constraint that makes the output a valid call: "required" and named as a JSON
    schema, "auto" as a lazily triggered grammar (`auto_tool_tag`); None for "none"."""
    if config is None or config.choice == "none":
        return None
    if config.choice == "auto":
        return {"schema_type": "structural_tag", "schema": auto_tool_tag(config)}
    if config.choice == "named":
        return {"schema_type": "json", "schema": config.parameters(config.name)}
    # each function's parameters become `$defs/__tool<i>` of the array schema, their local
    # `$ref`s ("#/$defs/X", as pydantic writes nested models) re-rooted there, so they resolve
    defs = {f"__tool{i}": _rebase_refs(config.parameters(name), f"#/$defs/__tool{i}")
            for i, name in enumerate(config.names)}
    calls = [{"type": "object",
              "properties": {"name": {"const": name},
                             "arguments": {"$ref": f"#/$defs/__tool{i}"}},
              "required": ["name", "arguments"]} for i, name in enumerate(config.names)]
    schema: dict[str, Any] = {"$defs": defs, "type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not config.parallel:
        schema["maxItems"] = 1
    return {"schema_type": "json", "schema": schema}


def auto_tool_tag(config: ToolConfig) -> dict[str, Any]:
    """XGrammar's structural tag for tool_choice "auto": text is free until the model writes
    `<tool_call>`; from there the block must be `<tool_call>\\n{"name": <one of the tools>,
    "arguments": <that tool's parameters>}\\n</tool_call>` (the Hermes format the prompt
    asks for), then text is free again. Whitespace inside the arguments is at most one
    character per gap, so a call cannot run away."""
    tags = [{"begin": f'{TOOL_CALL_START}\n{{"name": {json.dumps(name)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": config.parameters(name),
                         "max_whitespace_cnt": 1},
             "end": f"}}\n{TOOL_CALL_END}"} for name in config.names]
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [TOOL_CALL_START], "tags": tags,
        "at_least_one": False, "stop_after_first": not config.parallel}}


def _rebase_refs(schema: Any, root: str) -> Any:
    """`schema` with every local `$ref` ("#..." ) pointing below `root` instead of "#"."""
    if isinstance(schema, list):
        return [_rebase_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {key: value if key in ("enum", "const", "default", "examples")
               else _rebase_refs(value, root) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        rebased["$ref"] = root + ref[1:]
    return rebased


def tool_streamer(config: ToolConfig | None) -> ToolCallStreamer | None:
    """A fresh parser for one choice's output, or None when the output is plain content."""
    if config is None or config.choice == "none":
        return None
    if config.choice == "named":
        return NamedCallStreamer(config.name)
    if config.choice == "required":
        return CallArrayStreamer()
    return HermesStreamer(config.names, max_calls=None if config.parallel else 1)


def _template_uses_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def _hermes_messages(conversation: list[dict[str, Any]],
                     tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Tool calls and results written into message text for templates that ignore them."""
    rendered = []
    for message in conversation:
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if message["role"] == "assistant" and calls:
            blocks = [f"{TOOL_CALL_START}\n" + json.dumps(
                {"name": c["function"]["name"], "arguments": _arguments(c)},
                ensure_ascii=False) + f"\n{TOOL_CALL_END}" for c in calls]
            message["content"] = "\n".join(filter(None, [message.get("content")] + blocks))
        if message["role"] == "tool":
            message.pop("tool_call_id", None)
            message["content"] = f"<tool_response>\n{message['content']}\n</tool_response>"
        rendered.append(message)
    if tools:
        prompt = HERMES_SYSTEM_PROMPT.format(tools=json.dumps(tools, ensure_ascii=False))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" + prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def _arguments(call: dict[str, Any]) -> Any:
    arguments = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return arguments


def _check_tool_messages(conversation: list[dict[str, Any]]) -> None:
    """400s for tool turns the model could not have made sense of, as OpenAI's API refuses
    them: malformed `tool_calls`, and a tool message that does not answer a call of the
    assistant message its run of tool messages follows (no id, no such assistant message, or
    an id that is none of its calls' ids)."""
    answered: tuple[int, set[str] | None] | None = None   # (assistant index, its call ids)
    for i, message in enumerate(conversation):
        calls = message.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and "name" in c["function"] for c in calls)):
            raise APIError(f"messages[{i}].tool_calls must be a list of "
                           "{\"id\", \"type\": \"function\", \"function\": {\"name\", "
                           "\"arguments\"}}.", param=f"messages[{i}].tool_calls",
                           code="invalid_value")
        if message["role"] != "tool":
            ids = [c.get("id") for c in calls or ()]
            answered = ((i, set(ids) if all(isinstance(v, str) for v in ids) else None)
                        if message["role"] == "assistant" and calls else None)
            continue
        call_id = message.get("tool_call_id")
        if not call_id:
            raise APIError(f"messages[{i}] has role 'tool' but no tool_call_id; send the id of "
                           "the assistant tool call it answers.", param=f"messages[{i}]",
                           code="missing_required_parameter")
        if answered is None:
            raise APIError(f"messages[{i}] has role 'tool' but does not follow an assistant "
                           "message with tool_calls; a tool message answers one of the calls "
                           "of the assistant message before it.", param=f"messages[{i}]",
                           code="invalid_value")
        index, ids = answered
        if ids is not None and call_id not in ids:
            raise APIError(f"messages[{i}].tool_call_id {spelled(call_id)} is not the id of a "
                           f"call in messages[{index}].tool_calls "
                           f"({', '.join(sorted(map(spelled, ids)))}); "
                           "send the id of the call it answers.",
                           param=f"messages[{i}].tool_call_id", code="invalid_value")


def template_inputs(tokenizer: Any, conversation: list[dict[str, Any]],
                    config: ToolConfig | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template kwargs) with the tools and tool turns in place."""
    _check_tool_messages(conversation)
    tools = config.tools if config is not None and config.choice != "none" else None
    if _template_uses_tools(tokenizer):
        messages = []
        for message in conversation:
            if message.get("tool_calls"):
                message = {**message, "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": _arguments(c)}}
                    for c in message["tool_calls"]]}
            messages.append(message)
        return messages, ({"tools": tools} if tools else {})
    return _hermes_messages(conversation, tools), {}
