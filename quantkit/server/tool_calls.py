"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` mean for a request's generation,
and the calls taken out of the text it generates, whole or as stream deltas.

    tool_choice          the text is constrained to                    the calls are read by
    "none" (or no tools) nothing (tools are not shown to the model)    nobody: the text is content
    "auto" (default)     hermes: each call, once the model opens one,  the family's parser (below)
                         to a tool's name and arguments schema; with
                         response_format too, the answer is either
                         JSON under it or calls. Other parsers: the
                         request's response_format, if any
    "required"           a JSON array of {"name", "arguments"} items,  RequiredCalls
                         each name one of the tools' and its
                         arguments valid under that tool's schema
                         (one item when parallel_tool_calls is false)
    {"function": NAME}   NAME's arguments schema                        NamedCall: the text is the arguments

Parsers of the formats models are trained to write (`--tool-call-parser` picks one; by default the chat
template decides, hermes when it names no format):
    hermes       Hermes, Qwen2.5:  <tool_call>{"name": …, "arguments": {…}}</tool_call> (one or more)
    internlm2    InternLM2:        <|action_start|><|plugin|>{"name": …, "parameters": {…}}<|action_end|>
                                   (its markers are special tokens: the request's text keeps them)
    llama3_json  Llama 3.1:        the whole answer is {"name": …, "parameters": {…}} (`;`-separated for
                                   several), optionally after <|python_tag|>
Text outside the calls is the message's content. A call whose JSON does not parse stays content.

An extractor sees a choice's text delta by delta (`feed`) and then its end (`finish`); each returns the
content delta and OpenAI's `tool_calls` deltas (`index`, then `id`, `type`, `function.name` with the
call's first arguments, later only more `function.arguments`).
"""

from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from quantkit.engine.structured import StructuredOutput
from quantkit.server.protocol import APIError, ChatCompletionRequest, NamedToolChoice

PARSERS = ("hermes", "internlm2", "llama3_json")
ANY_OBJECT = {"type": "object"}


def detect_parser(chat_template: Optional[str]) -> str:
    """The tool-call format a chat template teaches its model (hermes when it shows none)."""
    text = chat_template if isinstance(chat_template, str) else json.dumps(chat_template or "")
    if "<|action_start|>" in text or "<|plugin|>" in text:
        return "internlm2"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Delta:
    """What one piece of text adds: content, and `tool_calls` deltas as OpenAI streams them."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __iadd__(self, other: "Delta") -> "Delta":
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class Extractor(abc.ABC):
    """Base: every call found whole (`_call`), numbered in order."""

    def __init__(self) -> None:
        self.num_calls = 0

    @abc.abstractmethod
    def feed(self, text: str) -> Delta:
        """What `text`, the next piece of the answer, adds."""

    def finish(self) -> Delta:
        return Delta()

    def _call(self, name: str, arguments: str) -> dict:
        delta = {"index": self.num_calls, "id": new_call_id(), "type": "function",
                 "function": {"name": name, "arguments": arguments}}
        self.num_calls += 1
        return delta


def _call_of(text: str) -> Optional[tuple[str, str]]:
    """(name, arguments as JSON text) of a call's JSON ({"name", "arguments" or "parameters"}), or None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _call_of_value(value)


def _call_of_value(value: Any) -> Optional[tuple[str, str]]:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return value["name"], json.dumps(args, ensure_ascii=False)


class NamedCall(Extractor):
    """tool_choice names a function: the text is its arguments (constrained to its schema)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> Delta:
        if self.num_calls == 0:
            return Delta(tool_calls=[self._call(self.name, text)])
        return Delta(tool_calls=[{"index": 0, "function": {"arguments": text}}] if text else [])

    def finish(self) -> Delta:
        return self.feed("") if self.num_calls == 0 else Delta()


class RequiredCalls(Extractor):
    """tool_choice "required": a JSON array of calls (constrained); each call is sent once it is whole."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.pos: Optional[int] = None   # where the next item may start (after '[' or a ',')
        self.decoder = json.JSONDecoder()

    def feed(self, text: str) -> Delta:
        self.text += text
        out = Delta()
        if self.pos is None:
            start = self.text.find("[")
            if start < 0:
                return out
            self.pos = start + 1
        while True:
            pos = self.pos
            while pos < len(self.text) and self.text[pos] in " \t\r\n,":
                pos += 1
            try:
                value, end = self.decoder.raw_decode(self.text, pos)
            except ValueError:
                return out
            self.pos = end
            call = _call_of_value(value)
            if call is not None:
                out.tool_calls.append(self._call(*call))


class MarkedCalls(Extractor):
    """Calls between a start and an end marker (hermes, internlm2); the text outside is content. Text
    that may be the start of a marker is held back until it is known not to be."""

    def __init__(self, start: str, end: str) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.buffer = ""
        self.inside = False

    def feed(self, text: str) -> Delta:
        self.buffer += text
        out = Delta()
        while True:
            if not self.inside:
                i = self.buffer.find(self.start)
                if i < 0:
                    keep = _partial_suffix(self.buffer, self.start)
                    out.content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out.content += self.buffer[:i]
                self.buffer = self.buffer[i + len(self.start):]
                self.inside = True
            j = self.buffer.find(self.end)
            if j < 0:
                return out
            out += self._close(self.buffer[:j], self.start + self.buffer[:j] + self.end)
            self.buffer = self.buffer[j + len(self.end):]
            self.inside = False

    def finish(self) -> Delta:
        """A call left open when the text ended (a model that stops at its end token) counts if it parses."""
        if self.inside:
            out = self._close(self.buffer, self.start + self.buffer)
        else:
            out = Delta(content=self.buffer)
        self.buffer, self.inside = "", False
        return out

    def _close(self, body: str, raw: str) -> Delta:
        call = _call_of(body.strip())
        return Delta(tool_calls=[self._call(*call)]) if call is not None else Delta(content=raw)


class Llama3JsonCalls(Extractor):
    """Llama 3.1: an answer that starts with '{' (or <|python_tag|>) is one or more ';'-separated calls,
    read when the text ends; any other answer is content, streamed as it comes."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self.buffer = ""
        self.calls: Optional[bool] = None   # None: not yet known

    def feed(self, text: str) -> Delta:
        if self.calls is False:
            return Delta(content=text)
        self.buffer += text
        head = self.buffer.lstrip()
        if self.calls is None and head:
            if head.startswith("{") or head.startswith(self.TAG):
                self.calls = True
            elif not self.TAG.startswith(head):
                self.calls = False
                out, self.buffer = self.buffer, ""
                return Delta(content=out)
        return Delta()

    def finish(self) -> Delta:
        text, self.buffer = self.buffer, ""
        if not self.calls:
            return Delta(content=text)
        body = text.strip().removeprefix(self.TAG)
        calls = [_call_of(part.strip()) for part in body.split(";") if part.strip()]
        if not calls or any(c is None for c in calls):
            return Delta(content=text)
        return Delta(tool_calls=[self._call(*c) for c in calls])


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def make_parser(name: str) -> Extractor:
    if name == "hermes":
        return MarkedCalls("<tool_call>", "</tool_call>")
    if name == "internlm2":
        return MarkedCalls("<|action_start|><|plugin|>", "<|action_end|>")
    if name == "llama3_json":
        return Llama3JsonCalls()
    raise ValueError(f"unknown tool-call parser {name!r}: one of {', '.join(PARSERS)}")


@dataclass
class ToolPlan:
    """What a chat request's tools mean for its generation (see the module docstring)."""

    tools: Optional[list[dict]]              # for the chat template (None: the model is shown none)
    mode: str                                # none, auto, required, named
    grammar: Optional[StructuredOutput]      # the constraint of required / named
    parser: str
    named: Optional[str] = None

    @property
    def param(self) -> str:
        """The request field a 400 about this plan's grammar names."""
        return "tool_choice" if self.mode == "named" else "tools"

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the text must keep special tokens (InternLM2's call markers are special tokens)."""
        return self.mode == "auto" and self.parser == "internlm2"

    def extractor(self) -> Optional[Extractor]:
        if self.mode == "named":
            return NamedCall(self.named)
        if self.mode == "required":
            return RequiredCalls()
        if self.mode == "auto":
            return make_parser(self.parser)
        return None


def plan_tools(req: ChatCompletionRequest, parser: str, requested: Optional[StructuredOutput] = None) -> ToolPlan:
    """The request's ToolPlan; `parser` is the server's (flag or template); `requested` the grammar the
    request asks for itself (response_format and the like)."""
    tools = req.tools or []
    choice = req.tool_choice or ("auto" if tools else "none")
    if not tools or choice == "none":
        return ToolPlan(None, "none", None, parser)
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return ToolPlan(rendered, "named", StructuredOutput.json_schema(_arguments_schema(tool)), parser,
                        named=tool.function.name)
    if choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                    "arguments": _arguments_schema(t)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items} if len(items) > 1 else items[0],
                                  "minItems": 1}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan(rendered, "required", StructuredOutput.json_schema(schema), parser)
    if parser == "hermes":
        return ToolPlan(rendered, "auto", hermes_calls(tools, requested, req.parallel_tool_calls is not False),
                        parser)
    return ToolPlan(rendered, "auto", None, parser)


def hermes_calls(tools: list, requested: Optional[StructuredOutput], parallel: bool) -> StructuredOutput:
    """XGrammar's structural tag for `auto` in the Hermes format: free text in which every <tool_call> the
    model opens holds one of the tools' names and arguments valid under its schema; with a grammar of the
    request's own, the text is either that or one or more calls."""
    tags = [{"type": "tag", "begin": '<tool_call>\n{"name": ' + json.dumps(t.function.name) + ', "arguments": ',
             "content": {"type": "json_schema", "json_schema": _arguments_schema(t), "max_whitespace_cnt": 2},
             "end": "}\n</tool_call>"} for t in tools]
    if requested is None:
        fmt: dict = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
                     "stop_after_first": not parallel}
    else:
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                 "stop_after_first": not parallel}
        fmt = {"type": "or", "elements": [requested.as_format(), calls]}
    return StructuredOutput.structural_tag({"type": "structural_tag", "format": fmt})


def _arguments_schema(tool: Any) -> dict:
    params = tool.function.parameters
    if params is None:
        return ANY_OBJECT
    if not isinstance(params, dict):
        raise APIError(400, f"tool {tool.function.name!r}: parameters must be a JSON schema (an object)",
                       param="tools", code="invalid_value")
    return params


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """The request's messages as chat templates take them: text content, the assistant's earlier
    tool calls with their arguments as objects (templates write them with `tojson`), and tool turns with
    the id of the call they answer."""
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content parts are supported by this server",
                               param="messages", code="unsupported_parameter")
            content = "".join(part.text or "" for part in content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _as_object(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        messages.append(msg)
    return messages


def _as_object(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
