"""Model output -> OpenAI tool calls, incrementally, with one code path for streams and bodies.

A `ToolCallStreamer` is fed the output text as it is generated and returns OpenAI-shaped delta
pieces: `{"content": ...}` or `{"tool_calls": [{"index", "id", "type", "function": {"name",
"arguments"}}]}` for a new call, then `{"tool_calls": [{"index", "function": {"arguments"}}]}`
fragments. A call's `arguments` is by definition the concatenation of its fragments, and a
non-stream body runs the same streamer over the whole text, so the two always agree.

- `HermesStreamer` (tool_choice "auto"): Hermes-2-Pro's convention, which Qwen2.5, Hermes and
  many chat templates use: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  text outside the tags is content. The body is scanned as JSON: the header goes out when the
  name is complete, the arguments as they are generated; a closing tag inside a JSON string is
  text of the call.
- `NamedCallStreamer` (tool_choice naming a function): the whole output is the arguments
  object, generated under the function's JSON schema; fragments stream as they come.
- `CallArrayStreamer` (tool_choice "required"): the output is `[{"name": ..., "arguments":
  {...}}, ...]` generated under a JSON schema (server.tools); each call's header is sent when
  its name is complete and its arguments stream raw, character for character.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
logger = logging.getLogger(__name__)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def message_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallStreamer:
    """Base: collects the calls and content it emits (see the module doc)."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content_parts: list[str] = []
        self.held_space = ""     # whitespace before any content: not sent unless text follows
        self.whole = False       # run(): a whole output, nothing streamed

    @property
    def content(self) -> str | None:
        """Content outside tool calls, exactly as streamed (so a stream's concatenated content
        equals the body's); None when there is none but whitespace (only calls were made:
        whitespace before the first text is held back, and dropped if no text follows)."""
        return "".join(self.content_parts) or None

    def _content(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if not self.content_parts and not (self.held_space + text).strip():
            self.held_space += text
            return []
        text, self.held_space = self.held_space + text, ""
        self.content_parts.append(text)
        return [{"content": text}]

    def _header(self, name: str, arguments: str = "") -> list[dict[str, Any]]:
        call = ToolCall(new_call_id(), name, arguments)
        self.calls.append(call)
        return [{"tool_calls": [{"index": len(self.calls) - 1, **call.message_dict()}]}]

    def _arguments(self, fragment: str) -> list[dict[str, Any]]:
        if not fragment:
            return []
        self.calls[-1].arguments += fragment
        return [{"tool_calls": [{"index": len(self.calls) - 1,
                                 "function": {"arguments": fragment}}]}]

    def feed(self, text: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    def finish(self) -> list[dict[str, Any]]:
        return []

    def run(self, text: str) -> "ToolCallStreamer":
        """Feed a whole output and finish (the non-stream path: nothing was sent yet, so a
        call that turns out broken can still become content)."""
        self.whole = True
        self.feed(text)
        self.finish()
        return self


class NamedCallStreamer(ToolCallStreamer):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[dict[str, Any]]:
        pieces = self._header(self.name) if not self.calls else []
        return pieces + self._arguments(text)

    def finish(self) -> list[dict[str, Any]]:
        return self._header(self.name) if not self.calls else []


_NO_VALUE, _VALUE_NEXT = -1, -2   # CallArrayStreamer.value_start before a member's value


class CallArrayStreamer(ToolCallStreamer):
    """Scans `[{"name": "...", "arguments": {...}}, ...]` one character at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.pos = 0             # characters scanned
        self.depth = 0           # open [ and { outside strings
        self.in_string = self.escape = False
        self.key_start = -1      # start of the member key being read at depth 2
        self.key = None          # last member key at depth 2
        self.value_start = _NO_VALUE  # start of that member's value (or a sentinel)
        self.sent = 0            # end of the arguments text already sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        pieces: list[dict[str, Any]] = []
        while self.pos < len(self.text):
            pieces += self._step(self.text[self.pos])
            self.pos += 1
        if self._streaming_arguments():
            pieces += self._arguments(self.text[self.sent:self.pos])
            self.sent = self.pos
        return pieces

    def _streaming_arguments(self) -> bool:
        """Inside the current call's arguments object ("parameters" is read as "arguments";
        arguments written as a JSON string are left to the caller)."""
        return (self.key in ("arguments", "parameters") and self.value_start >= 0
                and bool(self.calls) and self.text[self.value_start] == "{")

    def _step(self, char: str) -> list[dict[str, Any]]:
        at = self.pos
        if self.in_string:
            if self.escape:
                self.escape = False
            elif char == "\\":
                self.escape = True
            elif char == '"':
                self.in_string = False
                return self._string_end(at)
            return []
        if char == '"':
            self.in_string = True
            if self.depth == 2 and self.value_start == _VALUE_NEXT:
                self.value_start = self.sent = at
            elif self.depth == 2 and self.value_start == _NO_VALUE:
                self.key_start = at
            return []
        if char in "[{":
            if self.depth == 2 and self.value_start == _VALUE_NEXT:
                self.value_start = self.sent = at
            self.depth += 1
        elif char in "]}":
            self.depth -= 1
            if self.depth == 1:           # an item closed
                return self._member_end(at)
        elif char == ":" and self.depth == 2:
            self.value_start = _VALUE_NEXT  # the value starts at the next token
        elif char == "," and self.depth == 2:
            return self._member_end(at)
        elif self.depth == 2 and self.value_start == _VALUE_NEXT and not char.isspace():
            self.value_start = self.sent = at   # a number, true, false or null
        return []

    def _string_end(self, at: int) -> list[dict[str, Any]]:
        if self.depth != 2:
            return []
        if self.value_start < 0 and self.key_start >= 0:
            self.key = json.loads(self.text[self.key_start:at + 1])
            self.key_start = -1
            return []
        if self.key == "name" and self.value_start >= 0:
            return self._header(json.loads(self.text[self.value_start:at + 1]))
        return []

    def _member_end(self, at: int) -> list[dict[str, Any]]:
        pieces = []
        if self._streaming_arguments():
            pieces = self._arguments(self.text[self.sent:at].rstrip())
        self.key, self.value_start, self.sent = None, _NO_VALUE, at
        return pieces


class HermesStreamer(ToolCallStreamer):
    """Args:
        tool_names: the functions the request offers; a call to another name stays content.
        max_calls: calls kept (1 when parallel_tool_calls is false); later ones are dropped.

    Inside `<tool_call>` the body is scanned as JSON (a `CallArrayStreamer` over `[` + body),
    so a `</tool_call>` inside a string of the arguments does not end the call, the header is
    sent once the name is complete and the arguments stream as they are generated. A block
    that does not parse as a call is reported: logged, and sent as content (never dropped).
    """

    def __init__(self, tool_names: Collection[str], max_calls: int | None = None) -> None:
        super().__init__()
        self.tool_names = set(tool_names)
        self.max_calls = max_calls
        self.pending = ""
        self.block: CallArrayStreamer | None = None   # the scanner of the open block
        self.body = ""                                # the open block's text
        self.block_sent = False                       # its header was sent

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.pending += text
        pieces: list[dict[str, Any]] = []
        while self.pending:
            if self.block is None:
                index = self.pending.find(TOOL_CALL_START)
                if index < 0:
                    held = _held_prefix(self.pending, TOOL_CALL_START)
                    cut = len(self.pending) - held
                    pieces += self._content(self.pending[:cut])
                    self.pending = self.pending[cut:]
                    break
                pieces += self._content(self.pending[:index])
                self.pending = self.pending[index + len(TOOL_CALL_START):]
                self.block, self.body, self.block_sent = CallArrayStreamer(), "", False
                self.block.feed("[")
                continue
            closed, more = self._scan_block()
            pieces += more
            if not closed:
                break
        return pieces

    def _scan_block(self) -> tuple[bool, list[dict[str, Any]]]:
        """Feed the open block up to its closing tag outside JSON strings (or all of the
        pending text, but a partial tag). Returns (closed, pieces)."""
        pieces, start = [], 0
        while True:
            index = self.pending.find(TOOL_CALL_END, start)
            if index < 0:
                # a partial closing tag at the end is held back, unless the text before it
                # leaves the scanner inside a JSON string (then it is the call's text): asked
                # after feeding that text, not before (a name's opening quote in the last
                # feed made a tag that followed the object count as string text, and every
                # later character went into the call)
                cut = len(self.pending) - _held_prefix(self.pending, TOOL_CALL_END)
                pieces += self._feed_block(self.pending[:cut])
                if self.block.in_string:
                    pieces += self._feed_block(self.pending[cut:])
                    cut = len(self.pending)
                self.pending = self.pending[cut:]
                return False, pieces
            pieces += self._feed_block(self.pending[:index])
            self.pending = self.pending[index:]
            if not self.block.in_string:
                self.pending = self.pending[len(TOOL_CALL_END):]
                return True, pieces + self._end_block(closed=True)
            pieces += self._feed_block(TOOL_CALL_END)     # inside a string: the call's text
            self.pending, start = self.pending[len(TOOL_CALL_END):], 0

    def _feed_block(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.body += text
        inner = self.block.feed(text)
        if not inner:
            return []
        if not self.block_sent:              # inner starts with the call's header
            name = self.block.calls[0].name
            if name not in self.tool_names or (self.max_calls is not None
                                               and len(self.calls) >= self.max_calls):
                return []                    # settled when the block ends
            self.calls.append(self.block.calls[0])
            self.block_sent = True
        for piece in inner:
            piece["tool_calls"][0]["index"] = len(self.calls) - 1
        return inner

    def finish(self) -> list[dict[str, Any]]:
        pending, self.pending = self.pending, ""
        if self.block is not None:           # the model stopped before </tool_call>
            return self._feed_block(pending) + self._end_block(closed=False)
        return self._content(pending)

    def _end_block(self, closed: bool) -> list[dict[str, Any]]:
        block, body, sent = self.block, self.body, self.block_sent
        self.block, self.body, self.block_sent = None, "", False
        parsed = parse_call(body, self.tool_names)
        if sent:
            call = block.calls[0]
            if not call.arguments and parsed is not None:   # arguments written as a string
                return self._arguments(parsed[1])
            if parsed is None and self.whole:   # not streamed yet: the block becomes content
                self.calls.remove(call)
                logger.warning("a <tool_call> block does not parse as a call; sent as content: "
                               "%r", body[:200])
                return self._content(TOOL_CALL_START + body + (TOOL_CALL_END if closed else ""))
            if closed and parsed is None:   # streamed: its header and arguments are out
                logger.warning("tool call %r: its arguments are not a JSON object: %r",
                               call.name, body[:200])
            return []
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return []
        if parsed is None:
            logger.warning("a <tool_call> block is not a call of the offered tools; sent as "
                           "content: %r", body[:200])
            return self._content(TOOL_CALL_START + body + (TOOL_CALL_END if closed else ""))
        return self._header(*parsed)


def parse_call(body: str, tool_names: Collection[str]) -> tuple[str, str] | None:
    """`{"name": ..., "arguments": {...}}` -> (name, arguments JSON text), or None if it is
    not a call to one of `tool_names` ("parameters" is accepted for "arguments")."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or value.get("name") not in tool_names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0
