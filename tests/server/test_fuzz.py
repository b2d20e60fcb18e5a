"""Property-based fuzz of both endpoints' bodies against the live shared `quantkit serve` (hypothesis):
mostly plausible requests with hostile values (huge and negative ints, NaN and Infinity written as raw
JSON, wrong types, unicode, long stop lists, deep nesting, odd messages, token-id prompts). Every answer
is 200 or a 4xx in OpenAI's error body; a normal request succeeds after every batch; at the end nothing
is in flight and every KV block is free.

Bounded and reproducible: a fixed number of examples per batch, each batch under its own seed and
starting with one of the bodies that took the engine down before (KNOWN), no example database;
generated answers are at most 4 tokens.
"""

from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, example, given, seed, settings
from hypothesis import strategies as st

from quantkit_testing.serve_process import SERVED_NAME, wait_idle

BATCHES = 3
EXAMPLES_PER_BATCH = 100
VOCAB = 320   # tests/support/quantkit_testing/tiny.py's model
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
DEEP = "\x00deep:"   # a string standing for that many nested arrays, spliced into the JSON text

# --- values ---------------------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, VOCAB - 1, VOCAB, 2**31, 2**31 + 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64 - 1, 2**64,
             2**70, -2**70, 10**30]
hostile_ints = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-2**80, 2**80))
hostile_floats = st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324,
                                             -0.0, 1e-30, 1e30]), st.floats(allow_nan=True, allow_infinity=True))
texts = st.text(max_size=30)   # any character but a surrogate
odd_texts = st.text(st.characters(exclude_categories=[]), max_size=30)   # lone surrogates and controls too
deep = st.integers(1, 3000).map(lambda n: f"{DEEP}{n}")
scalars = st.one_of(st.none(), st.booleans(), hostile_ints, hostile_floats, odd_texts)
anything = st.recursive(st.one_of(scalars, deep), lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                          st.dictionaries(texts, inner, max_size=4)),
                        max_leaves=8)
MISSING = object()   # an override that drops the field


def hostile(*specific) -> st.SearchStrategy:
    """Mostly the field's own edge values, else any JSON."""
    own = st.one_of(*specific)
    return st.integers(0, 3).flatmap(lambda i: own if i else anything)   # one_of would draw each equally


# Generation length: small when valid, so that every 200 is quick; the hostile ones are all invalid.
small = st.integers(1, 4)
bad_lengths = st.sampled_from([0, -1, 2**31 + 1, 2**64, -2**70, 1.5, "9", [], float("nan"), float("inf")])
token_ids = st.integers(0, VOCAB - 1)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"])},
                                optional={"content": texts, "name": texts})
odd_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "audio", ""])},
                                 optional={"text": odd_texts, "image_url": anything})
odd_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "wizard", ""])},
    optional={"content": st.one_of(odd_texts, st.lists(odd_part, max_size=3), st.none(), anything),
              "name": anything})
cap_messages = st.integers(1020, 1030).map(lambda k: [{"role": "user", "content": "x"}] * k)   # --max-messages

# Each field: (a plausible value, hostile ones). A body is plausible fields plus up to three hostile ones.
SAMPLING = {
    "model": (st.just(SERVED_NAME), st.one_of(st.sampled_from(["gpt-4o", ""]), anything)),
    "temperature": (st.floats(0, 2), hostile(hostile_floats)),
    "top_p": (st.floats(0.01, 1), hostile(hostile_floats)),
    "top_k": (st.integers(-1, VOCAB), hostile(hostile_ints)),
    "min_p": (st.floats(0, 1), hostile(hostile_floats)),
    "seed": (st.integers(-2**63, 2**64 - 1), hostile(hostile_ints)),
    "stop": (st.one_of(texts, st.lists(texts, max_size=4)),
             hostile(st.lists(texts, min_size=15, max_size=18), st.text(min_size=510, max_size=515),
                     st.lists(odd_texts, max_size=4))),
    "stop_token_ids": (st.lists(token_ids, max_size=5), hostile(st.lists(hostile_ints, min_size=1, max_size=3))),
    "n": (st.integers(1, 3), hostile(st.sampled_from([0, -1, 65, 2**64, 1.5, "2"]))),
    "stream": (st.booleans(), anything),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}), anything),
    "presence_penalty": (st.floats(-2, 2), hostile(hostile_floats)),
    "frequency_penalty": (st.floats(-2, 2), hostile(hostile_floats)),
    "repetition_penalty": (st.floats(0.5, 2), hostile(hostile_floats)),
    "ignore_eos": (st.booleans(), anything),
    "min_tokens": (st.integers(0, 4), hostile(hostile_ints)),
    "logit_bias": (st.just({}), anything),
    "user": (texts, anything),
    "max_tokens": (small, hostile(bad_lengths)),
}
CHAT = {
    **SAMPLING,
    "messages": (st.lists(message, min_size=1, max_size=4),
                 st.one_of(st.lists(odd_message, max_size=4), cap_messages, anything, st.just(MISSING))),
    "max_completion_tokens": (small, bad_lengths),
    "logprobs": (st.booleans(), anything),
    "top_logprobs": (st.integers(0, 20), hostile(hostile_ints)),
    "tools": (st.just([]), anything),
    "tool_choice": (st.sampled_from(["none", "auto"]), anything),
    "parallel_tool_calls": (st.booleans(), anything),
    "response_format": (st.sampled_from([{"type": "text"}, {"type": "json_object"}]), anything),
}
# Structured output, on both endpoints: plausible grammars, or anything in their place.
GRAMMARS = {
    "guided_regex": (st.sampled_from(["[a-z]{1,3}", "(yes|no)", "[0-9]+"]), anything),
    "guided_choice": (st.lists(texts.filter(bool), min_size=1, max_size=3), anything),
    "guided_json": (st.just({"type": "boolean"}), anything),
    "guided_grammar": (st.just('root ::= "a" | "b"'), anything),
    "structured_outputs": (st.sampled_from([{"regex": "[0-9]"}, {"choice": ["x"]}, {"json": {"enum": [1, 2]}}]),
                           anything),
}
CHAT.update(GRAMMARS)
COMPLETIONS = {
    **SAMPLING,
    "prompt": (st.one_of(texts.filter(str.strip), st.lists(texts.filter(str.strip), min_size=1, max_size=4),
                         st.lists(token_ids, min_size=1, max_size=40),
                         st.lists(st.lists(token_ids, min_size=1, max_size=10), min_size=1, max_size=3)),
               hostile(st.lists(hostile_ints, max_size=5), st.lists(st.lists(hostile_ints, max_size=3), max_size=3),
                       st.integers(250, 260).map(lambda k: ["x"] * k),   # --max-prompts-per-request
                       st.lists(odd_texts, max_size=4), st.just(""), st.just([]), st.just(MISSING))),
    "logprobs": (st.integers(0, 20), hostile(hostile_ints)),
    "echo": (st.just(False), anything),
    "best_of": (st.just(1), hostile(hostile_ints)),
    **GRAMMARS,
}
REQUIRED = ("max_tokens", "messages", "prompt")


def to_json(value: object, ascii_only: bool) -> bytes:
    """JSON text with NaN and Infinity written raw (json.dumps does) and each DEEP marker as nested arrays;
    non-ASCII as escapes or as UTF-8 (a lone surrogate then makes the body invalid UTF-8)."""
    text = json.dumps(value, allow_nan=True, ensure_ascii=ascii_only)
    marker = json.dumps(DEEP)[:-1]   # the opening quote and the escaped marker
    while marker in text:
        start = text.index(marker)
        end = text.index('"', start + 1) + 1
        n = int(json.loads(text[start:end])[len(DEEP):])
        text = text[:start] + "[" * n + "]" * n + text[end:]
    return text.encode("utf-8", "surrogatepass")


@st.composite
def bodies(draw, fields: dict) -> bytes:
    """A request body as JSON text: the required fields and some optional ones, plausible, then (mostly)
    one field overridden with a hostile value; one in ten is any JSON value at all."""
    if draw(st.integers(0, 9)) == 0:
        return to_json(draw(anything), draw(st.booleans()))
    optional = [name for name in fields if name not in REQUIRED]
    chosen = draw(st.lists(st.sampled_from(optional), max_size=6, unique=True))
    body = {name: draw(fields[name][0]) for name in [*REQUIRED, *chosen] if name in fields}
    overrides = [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 3][draw(st.integers(0, 10))]   # mostly one, not masked by others
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=overrides, max_size=overrides, unique=True)):
        value = draw(fields[name][1])
        if value is MISSING:
            body.pop(name, None)
        else:
            body[name] = value
    return to_json(body, draw(st.booleans()))


# The bodies that took the engine down before the edge checked them (issue #25), one per batch.
KNOWN = {
    "chat": [b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1, "top_k": 1180591620717411303424}',
             (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "min_tokens": 2, '
              b'"stop_token_ids": [-5]}'),
             b"[" * 100_000],
    "completions": [b'{"prompt": "hi", "max_tokens": 2, "temperature": 1, "seed": 36893488147419103232}',
                    b'{"prompt": "hi", "max_tokens": 3, "min_tokens": 2, "stop_token_ids": [9223372036854775808]}',
                    b'{"prompt": [[5, 6], [-1]], "max_tokens": 2, "temperature": NaN}'],
}
assert all(len(known) == BATCHES for known in KNOWN.values())


# --- the checks -----------------------------------------------------------------------------------

def check_answer(url: str, body: bytes) -> None:
    r = requests.post(url, data=body, headers={"Content-Type": "application/json"}, timeout=60)
    if r.status_code != 200:
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:500], body[:2000])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], (r.text, body[:2000])
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [block[len("data: "):] for block in r.text.split("\n\n") if block.strip()]
        assert events[-1] == "[DONE]", (r.text[-500:], body[:2000])
        errors = [e for e in events[:-1] if "error" in json.loads(e)]
        assert not errors, (errors, body[:2000])
    else:
        assert r.json()["choices"], (r.text[:500], body[:2000])


def check_serving(url: str) -> None:
    r = requests.post(url + PATHS["chat"], json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                      timeout=60)
    assert r.status_code == 200, r.text
    r = requests.post(url + PATHS["completions"], json={"prompt": "hi", "max_tokens": 2, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_fuzzed_bodies_get_200_or_4xx(qk_server, endpoint):
    url = qk_server.url + PATHS[endpoint]
    strategy = bodies(CHAT if endpoint == "chat" else COMPLETIONS)
    for batch in range(BATCHES):
        @seed(batch)
        @example(body=KNOWN[endpoint][batch])
        @settings(max_examples=EXAMPLES_PER_BATCH, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @given(body=strategy)
        def answers(body: bytes) -> None:
            check_answer(url, body)

        answers()
        check_serving(qk_server.url)
    m = wait_idle(qk_server.url)
    assert m["quantkit_num_requests_in_flight"] == 0 and m["quantkit_kv_blocks_used"] == 0, m
