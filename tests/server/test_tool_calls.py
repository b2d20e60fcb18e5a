"""Tool calls read from generated text (quantkit/server/tool_calls.py): each parser finds the same calls
and content whether the text comes whole or one character at a time, holds back what may be a marker's
start, keeps unparsable calls as content, and picks its format from the chat template; the Hermes `auto`
grammar; the --tool-call-parser and --grammar-compile-timeout checks."""

from __future__ import annotations

import json

import pytest

from quantkit.server.tool_calls import (NamedCall, RequiredCalls, Delta, detect_parser, make_parser)


def _run(extractor, pieces) -> tuple[str, list[dict]]:
    """content and whole calls (assembled by index, as clients assemble stream deltas)."""
    total = Delta()
    for p in pieces:
        total += extractor.feed(p)
    total += extractor.finish()
    calls: dict[int, dict] = {}
    for d in total.tool_calls:
        call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
        call["name"] = call["name"] or d["function"].get("name")
        call["arguments"] += d["function"].get("arguments", "")
    return total.content, [{"name": c["name"], "arguments": json.loads(c["arguments"])} for c in calls.values()]


HERMES = ('I will check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call> done <tool')
INTERNLM2 = 'ok<|action_start|><|plugin|>\n{"name": "add", "parameters": {"a": 1, "b": 2}}<|action_end|>'
LLAMA = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
CASES = [
    ("hermes", HERMES, "I will check. \n done <tool",
     [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {"a": 1}}]),
    ("hermes", "plain <b>text</b> <tool_call>{not json}</tool_call>", "plain <b>text</b> <tool_call>{not json}</tool_call>", []),
    ("hermes", 'x<tool_call>{"name": "f", "arguments": {}}', "x", [{"name": "f", "arguments": {}}]),   # no end tag
    ("internlm2", INTERNLM2, "ok", [{"name": "add", "arguments": {"a": 1, "b": 2}}]),
    ("llama3_json", LLAMA, "", [{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]),
    ("llama3_json", "  Hello {there}", "  Hello {there}", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
@pytest.mark.parametrize("chunked", [False, True])
def test_parsers(parser, text, content, calls, chunked):
    got_content, got_calls = _run(make_parser(parser), list(text) if chunked else [text])
    assert (got_content, got_calls) == (content, calls)


def test_marker_start_is_held_back_until_known():
    parser = make_parser("hermes")
    assert parser.feed("Hi <tool").content == "Hi "
    assert parser.feed("box>").content == "<toolbox>"


def test_named_and_required():
    content, calls = _run(NamedCall("add"), ['{"a":', ' 1}'])
    assert content == "" and calls == [{"name": "add", "arguments": {"a": 1}}]
    required = RequiredCalls()
    assert required.feed('[{"name": "add", "arguments": {"a": ').tool_calls == []
    first = required.feed('1}}, {"name": "f"').tool_calls
    assert [d["function"]["name"] for d in first] == ["add"] and first[0]["index"] == 0
    second = required.feed(', "arguments": {}}]').tool_calls
    assert second[0]["index"] == 1 and second[0]["function"] == {"name": "f", "arguments": "{}"}


@pytest.mark.parametrize("template, parser", [
    ("{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
    ("<|im_start|>system name=<|plugin|>", "internlm2"),
    ("{{ '<|python_tag|>' }}{{ 'ipython' }}", "llama3_json"),
    ("{{ messages }}", "hermes"),
    (None, "hermes"),
])
def test_detect_parser(template, parser):
    assert detect_parser(template) == parser


def test_hermes_auto_grammar():
    """`auto` with the Hermes format: free text, but a <tool_call> holds one of the tools with valid arguments;
    with a response_format too, the text is either JSON under it or calls."""
    from quantkit.engine.structured import Grammars, StructuredOutput
    from quantkit.server.protocol import ChatCompletionRequest
    from quantkit.server.tool_calls import plan_tools
    from quantkit_testing.tiny import make_tokenizer

    tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [tool]})
    grammars = Grammars(make_tokenizer(), 320)

    def accepts(grammar: StructuredOutput, text: str) -> bool:
        m = grammars.matcher(grammar, frozenset()).matcher
        return m.accept_string(text) and m.is_completed()

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    free = plan_tools(req, "hermes").grammar
    assert accepts(free, "any text") and accepts(free, "ok " + call + " done") and accepts(free, call + call)
    assert not accepts(free, '<tool_call>\n{"name": "sub", "arguments": {"a": 1}}\n</tool_call>')
    assert not accepts(free, '<tool_call>\n{"name": "add", "arguments": {"a": "one"}}\n</tool_call>')
    once = plan_tools(req.model_copy(update={"parallel_tool_calls": False}), "hermes").grammar
    assert accepts(once, call) and not accepts(once, call + call)
    answer = StructuredOutput.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                           "required": ["ok"]})
    either = plan_tools(req, "hermes", answer).grammar
    assert accepts(either, '{"ok": true}') and accepts(either, call) and not accepts(either, "any text")
    assert plan_tools(req, "internlm2").grammar is None   # its markers are special tokens: parsed, not constrained


def test_tool_call_parser_flag_is_checked():
    from quantkit.config import UserError
    from quantkit.server.launch import ServeConfig

    assert ServeConfig(model="m", tool_call_parser="internlm2").tool_call_parser == "internlm2"
    with pytest.raises(UserError, match="--tool-call-parser 'qwen' is not one of hermes, internlm2, llama3_json"):
        ServeConfig(model="m", tool_call_parser="qwen")


def test_grammar_compile_timeout_is_a_400():
    """A grammar still compiling after --grammar-compile-timeout seconds is answered 400 naming the field."""
    import asyncio
    import threading

    from quantkit.engine.structured import StructuredOutput
    from quantkit.server.limits import RequestLimits
    from quantkit.server.protocol import APIError
    from quantkit.server.structured import GrammarChecker

    release = threading.Event()

    class Slow:   # stands in for XGrammar's compiler: done only when released
        def check(self, grammar) -> None:
            release.wait(10)

    checker = GrammarChecker(None, 320, RequestLimits(grammar_compile_timeout=1))
    checker._grammars = Slow()
    with pytest.raises(APIError) as err:
        asyncio.run(checker.check(StructuredOutput.regex("a+"), "guided_regex"))
    release.set()
    checker.close()
    assert err.value.status == 400 and err.value.param == "guided_regex"
    assert "took more than 1 s to compile (--grammar-compile-timeout)" in err.value.message
