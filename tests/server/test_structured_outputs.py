"""Structured output and tool calls through the real `openai` client against `quantkit serve` (the suite's
shared server on a tiny random Llama with a Hermes-style chat template, and one with an InternLM2-style
template): every answer constrained by a JSON schema validates against it, forced tool calls validate
against their tool's schema (whole and streamed), calls the model writes are parsed, and hostile
grammars are 400s after which the server keeps serving."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

from quantkit_testing.serve_process import SERVED_NAME, ServerProcess, wait_idle
from quantkit_testing.structured_cases import SCHEMAS

MESSAGES = [{"role": "user", "content": "the model quantizes weights"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(qk_server):
    from openai import OpenAI

    return OpenAI(base_url=qk_server.url + "/v1", api_key="unused", max_retries=0)


def _prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"the cache keeps keys {i} and values"}]


def test_json_schemas_every_answer_validates(client):
    """30 schemas, sent together (batched in the engine with unconstrained requests), half greedy, half
    sampled: each answer is JSON valid under its schema."""
    def ask(i: int):
        return client.chat.completions.create(
            model=SERVED_NAME, messages=_prompt(i), max_tokens=200, temperature=0 if i % 2 else 1.0, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i],
                                                                    "strict": True}})

    def free(i: int):
        return client.chat.completions.create(model=SERVED_NAME, messages=_prompt(i), max_tokens=20)

    with ThreadPoolExecutor(12) as pool:
        plain = [pool.submit(free, i) for i in range(4)]
        answers = list(pool.map(ask, range(len(SCHEMAS))))
    for schema, answer in zip(SCHEMAS, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert all(f.result().choices[0].message.content is not None for f in plain)


def test_unconstrained_answers_are_unchanged_by_constrained_neighbours(client):
    """A greedy request gives the same text alone and batched with constrained ones."""
    alone = client.completions.create(model=SERVED_NAME, prompt="the model", max_tokens=24, temperature=0)
    with ThreadPoolExecutor(6) as pool:
        mixed = [pool.submit(client.completions.create, model=SERVED_NAME, prompt=f"keys {i}", max_tokens=30,
                             temperature=0, extra_body={"structured_outputs": {"regex": "[a-z]{3,9}"}})
                 for i in range(5)]
        again = client.completions.create(model=SERVED_NAME, prompt="the model", max_tokens=24, temperature=0)
    assert again.choices[0].text == alone.choices[0].text
    import re

    assert all(re.fullmatch("[a-z]{3,9}", f.result().choices[0].text) for f in mixed)


def test_pydantic_parse(client):
    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        city: str = Field(pattern="^[A-Z][a-z]{1,6}$")
        celsius: int = Field(ge=-30, le=45)
        sunny: bool

    completion = client.chat.completions.parse(model=SERVED_NAME, messages=MESSAGES, max_tokens=60,
                                               response_format=Reading)
    reading = completion.choices[0].message.parsed
    assert isinstance(reading, Reading) and -30 <= reading.celsius <= 45


@pytest.mark.parametrize("body, check", [
    ({"response_format": {"type": "json_object"}, "temperature": 0}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_choice": ["yes", "no", "maybe so"]}, lambda t: t in ("yes", "no", "maybe so")),
    ({"structured_outputs": {"choice": ["左", "right"]}}, lambda t: t in ("左", "right")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[3] == "-"),
    ({"structured_outputs": {"grammar": 'root ::= "(" [0-9] [0-9]? ")"'}},
     lambda t: t.startswith("(") and t.endswith(")") and t[1:-1].isdigit()),
    ({"guided_json": {"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 2}},
     lambda t: json.loads(t) in ([1, 1], [1, 2], [2, 1], [2, 2])),
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_other_grammars(qk_server, body, check, endpoint):
    if endpoint == "chat":
        r = requests.post(qk_server.url + "/v1/chat/completions",
                          json={"messages": MESSAGES, "max_tokens": 40, **body, "temperature": 1.0, "seed": 3})
        text = r.json()["choices"][0]["message"]["content"]
    else:
        if "response_format" in body:
            body = {"guided_json": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}}
            check = lambda t: isinstance(json.loads(t)["k"], bool)  # noqa: E731
        r = requests.post(qk_server.url + "/v1/completions",
                          json={"prompt": "the model", "max_tokens": 40, **body, "temperature": 1.0, "seed": 3})
        text = r.json()["choices"][0]["text"]
    assert r.status_code == 200 and check(text), (r.status_code, r.text)


def _calls_validate(message, expected_name=None, most=None) -> int:
    calls = message.tool_calls
    assert calls and (most is None or len(calls) <= most), message
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert expected_name is None or call.function.name == expected_name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    return len(calls)


def _streamed(stream) -> tuple[dict, str]:
    """The tool calls of a streamed answer, assembled by index as clients do; its finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] = call["name"] or (d.function.name if d.function else None)
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    return calls, finish


def test_forced_tool_calls_validate(client):
    """tool_choice required (one call, or parallel calls) and a named tool: 50 answers each way, every call
    valid under its tool's schema, finish_reason tool_calls; 10 of each streamed too. Sampled (temperature
    1, seeded), so that the calls differ."""
    named = {"type": "function", "function": {"name": "get_weather"}}

    def ask(i: int):
        choice, parallel = (named, None) if i % 2 else ("required", i % 4 == 0)
        return client.chat.completions.create(
            model=SERVED_NAME, messages=_prompt(i), tools=TOOLS, tool_choice=choice, max_tokens=150,
            temperature=1.0, seed=i, **({} if parallel is None else {"parallel_tool_calls": parallel}))

    def ask_streamed(i: int):
        choice = named if i % 2 else "required"
        return _streamed(client.chat.completions.create(
            model=SERVED_NAME, messages=_prompt(i), tools=TOOLS, tool_choice=choice, max_tokens=150,
            temperature=1.0, seed=100 + i, parallel_tool_calls=False, stream=True))

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(100)))
        streamed = list(pool.map(ask_streamed, range(20)))
    for i, answer in enumerate(answers):
        choice = answer.choices[0]
        # Parallel calls (i % 4 == 0) may go on until max_tokens (the random model likes ','): each whole
        # call is still valid.
        assert choice.finish_reason == "tool_calls" or i % 4 == 0, choice
        assert choice.message.content is None
        n = _calls_validate(choice.message, "get_weather" if i % 2 else None, None if i % 4 == 0 else 1)
        assert n == 1 or i % 4 == 0
    for i, (calls, finish) in enumerate(streamed):
        assert finish == "tool_calls" and list(calls) == [0], calls
        call = calls[0]
        assert call["id"].startswith("call_") and (call["name"] == "get_weather" or i % 2 == 0)
        jsonschema.validate(json.loads(call["arguments"]), SCHEMA_OF[call["name"]])


HERMES_CALL = ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
               '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>')


def _forced_text(text: str) -> dict:
    """Make the tiny model write `text` (a regex of it, as structured output), so that `auto` parses what the
    model wrote. Greedy: sampled, the model may spell the text in more tokens than its context holds."""
    import re

    return {"structured_outputs": {"regex": re.escape(text).replace("\\ ", " ").replace("\\\n", "\\n")},
            "temperature": 0}


def test_auto_parses_hermes_calls_and_round_trips(client, qk_server):
    messages = [{"role": "user", "content": "weather?"}]
    answer = client.chat.completions.create(model=SERVED_NAME, messages=messages, tools=TOOLS, max_tokens=200,
                                            extra_body=_forced_text(HERMES_CALL))
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("add", {"a": 2, "b": 3})]
    calls, finish = _streamed(client.chat.completions.create(
        model=SERVED_NAME, messages=messages, tools=TOOLS, max_tokens=200, stream=True,
        extra_body=_forced_text(HERMES_CALL)))
    assert finish == "tool_calls" and [c["name"] for c in calls.values()] == ["get_weather", "add"]
    # The calls and the tool's answers go back through the template (Hermes-style: <tool_call> in the prompt).
    # (One call of the two: the tiny model's context is 256 tokens.)
    first = choice.message.tool_calls[0]
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [first.model_dump()]},
                          {"role": "tool", "tool_call_id": first.id, "content": "sunny"}]
    follow = client.chat.completions.create(model=SERVED_NAME, messages=history, tools=TOOLS, max_tokens=5)
    assert follow.choices[0].finish_reason in ("stop", "length")
    assert follow.usage.prompt_tokens > answer.usage.prompt_tokens + 20   # the call and its answer are in it
    # tool_choice none: the tools are not shown and nothing is parsed.
    plain = client.chat.completions.create(model=SERVED_NAME, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=200, extra_body=_forced_text(HERMES_CALL))
    assert plain.choices[0].message.content == HERMES_CALL and not plain.choices[0].message.tool_calls
    assert plain.usage.prompt_tokens < answer.usage.prompt_tokens


INTERNLM2_TEMPLATE = (
    "{% if tools %}<|im_start|>system name=<|plugin|>\n{{ tools | map(attribute='function') "
    "| map(attribute='name') | join(', ') }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>environment name=<|plugin|>\n{{ m['content'] }}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{% for c in m.tool_calls or [] %}"
    "<|action_start|><|plugin|>\n{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}"
    "<|action_end|>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def internlm2_server(chat_model_dir, tmp_path_factory):
    """The tiny model with an InternLM2-style template, whose call markers are special tokens."""
    import shutil

    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("internlm2-style") / "model"
    shutil.copytree(chat_model_dir, directory)
    tok = AutoTokenizer.from_pretrained(str(directory))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|action_start|>",
                                                          "<|action_end|>", "<|plugin|>"]})
    tok.chat_template = INTERNLM2_TEMPLATE
    tok.save_pretrained(str(directory))
    server = ServerProcess(str(directory), "--served-model-name", SERVED_NAME, "--num-kv-tokens", "2048", "--quiet",
                           "--engine-thread",   # one process: starts sooner
                           log=tmp_path_factory.mktemp("serve-log") / "internlm2.log")
    yield server
    assert server.stop() == 0


def test_auto_parses_internlm2_calls(internlm2_server):
    from openai import OpenAI

    client = OpenAI(base_url=internlm2_server.url + "/v1", api_key="unused", max_retries=0)
    text = 'Let me check.<|action_start|><|plugin|>\n{"name": "add", "parameters": {"a": 4, "b": 5}}<|action_end|>'
    answer = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                            extra_body=_forced_text(text))
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 4, "b": 5}
    # Its markers are special tokens: the tokenizer encodes them so, and the answer's text keeps them when the
    # model writes them as such (skip_special_tokens is off for this parser).
    history = MESSAGES + [choice.message.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "9"}]
    follow = client.chat.completions.create(model=SERVED_NAME, messages=history, tools=TOOLS, max_tokens=5)
    assert follow.usage.prompt_tokens > answer.usage.prompt_tokens


DEEP = {"type": "string"}
for _ in range(40):
    DEEP = {"type": "object", "properties": {"a": DEEP}, "required": ["a"]}


@pytest.mark.parametrize("body, param", [
    ({"guided_regex": "(a"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_json": {"type": "foo"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}},
     "guided_json"),   # past --max-grammar-chars
    ({"guided_regex": "a" * 70000}, "guided_regex"),
    ({"guided_regex": "x", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "unknown"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_grammars_and_tools_are_400(qk_server, body, param):
    r = requests.post(qk_server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_hostile_grammars_never_5xx(qk_server):
    """Deep schemas, catastrophic and huge-repetition regexes, recursive $refs: a 200 with a valid answer or a
    400, never a 5xx; the server then still answers and holds no KV block."""
    hostile = [
        {"guided_json": DEEP},
        {"guided_regex": "(a+)+$"},
        {"guided_regex": "(a|aa)*b"},
        {"guided_regex": "a{100000}"},
        {"guided_regex": "(x{1,1000}){1,1000}"},
        {"guided_json": {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
                         "$ref": "#/$defs/n"}},
        {"guided_json": {"$ref": "#/$defs/missing"}},
        {"guided_json": {"type": "string", "minLength": 10**9}},
        {"guided_json": {"type": "array", "minItems": 10**9}},
        {"guided_grammar": "root ::= root"},
        {"guided_grammar": "root ::= " + " ".join(['"a"'] * 5000)},
        {"structured_outputs": {"regex": "[\\u0000-\\uffff]*"}},
    ]
    for body in hostile:
        r = requests.post(qk_server.url + "/v1/chat/completions",
                          json={"messages": MESSAGES, "max_tokens": 8, **body}, timeout=60)
        assert r.status_code in (200, 400), (body, r.status_code, r.text)
    ok = requests.post(qk_server.url + "/v1/chat/completions",
                       json={"messages": MESSAGES, "max_tokens": 30, "guided_choice": ["fine", "well"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] in ("fine", "well")
    assert wait_idle(qk_server.url)["quantkit_kv_blocks_used"] == 0


def test_auto_with_response_format_is_json_or_calls(client):
    """tools (auto) and a response schema in one request: every answer is JSON valid under the schema, or
    calls valid under their tools' schemas."""
    schema = {"type": "object", "properties": {"answer": {"type": "string", "pattern": "^[a-z]{1,6}$"}},
              "required": ["answer"], "additionalProperties": False}

    def ask(i: int):
        return client.chat.completions.create(
            model=SERVED_NAME, messages=_prompt(i), tools=TOOLS, max_tokens=120, temperature=1.0, seed=i,
            parallel_tool_calls=False,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(16)))
    for answer in answers:
        choice = answer.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            _calls_validate(choice.message, most=1)
        else:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), schema)
