"""`quantkit serve` over HTTP: the routes, the chat template, usage counts, sampling fields, the stream
against the whole answer, n, logprobs, stop strings, the chat page."""

from __future__ import annotations

import json

import pytest
import requests

from quantkit_testing.serve_process import CHAT_TEMPLATE, SERVED_NAME

MESSAGES = [{"role": "system", "content": "you answer about caches"},
            {"role": "user", "content": "the model quantizes weights"},
            {"role": "assistant", "content": "into groups of integers"},
            {"role": "user", "content": "and the cache keeps keys?"}]


def post(url: str, path: str, body: dict) -> dict:
    r = requests.post(url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(response: requests.Response) -> list:
    """The JSON events of a stream, and the final '[DONE]' as the string."""
    events = []
    for block in response.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def template_ids(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def test_health_and_models(qk_server):
    assert requests.get(qk_server.url + "/health", timeout=10).json() == {"status": "ok", "engine_restarts": 0}
    data = requests.get(qk_server.url + "/v1/models", timeout=10).json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == [SERVED_NAME]
    assert data["data"][0]["max_model_len"] == 256   # the tiny config's max_position_embeddings


def test_chat_uses_the_template_and_counts_usage(qk_server, chat_tokenizer):
    out = post(qk_server.url, "/v1/chat/completions",
               {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 7, "temperature": 0, "ignore_eos": True})
    ids = template_ids(chat_tokenizer, MESSAGES)
    # The template was applied: the system turn and both user turns are in the prompt, in order.
    text = chat_tokenizer.decode(ids)
    assert text.index("<|system|>you answer") < text.index("<|user|>the model") < text.rindex("<|assistant|>")
    assert "{%" in CHAT_TEMPLATE
    assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 7, "total_tokens": len(ids) + 7}
    choice = out["choices"][0]
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    # Greedy: the same request gives the same answer.
    again = post(qk_server.url, "/v1/chat/completions",
                 {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 7, "temperature": 0, "ignore_eos": True})
    assert again["choices"][0]["message"]["content"] == choice["message"]["content"]


def test_completion_usage_and_token_id_prompts(qk_server, chat_tokenizer):
    prompt = "the cache keeps keys and values for every token"
    ids = chat_tokenizer(prompt)["input_ids"]
    out = post(qk_server.url, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                  "ignore_eos": True})
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == 5
    assert out["object"] == "text_completion" and out["model"] == SERVED_NAME
    by_ids = post(qk_server.url, "/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0,
                                                     "ignore_eos": True})
    assert by_ids["choices"][0]["text"] == out["choices"][0]["text"]
    assert by_ids["usage"] == out["usage"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_gives_the_whole_answers_text_for_the_same_seed(qk_server, path):
    body = {"max_tokens": 12, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 1234, "ignore_eos": True}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "the model quantizes"})
    whole = post(qk_server.url, path, body)
    r = requests.post(qk_server.url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_event, chunks = events[-2], events[:-2]
    assert usage_event["choices"] == [] and usage_event["usage"] == whole["usage"]
    if "chat" in path:
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        expected = whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        expected = whole["choices"][0]["text"]
    assert len(chunks) >= 3                     # tokens arrive as they are made, not in one piece
    assert text == expected and text
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)   # include_usage: null on every chunk but the last
    # Another seed samples another answer (12 tokens out of a 320-word vocabulary).
    other = post(qk_server.url, path, {**body, "seed": 99})
    key = "message" if "chat" in path else None
    other_text = other["choices"][0]["message"]["content"] if key else other["choices"][0]["text"]
    assert other_text != expected


def test_n_choices_with_seeds_and_max_completion_tokens(qk_server):
    out = post(qk_server.url, "/v1/chat/completions",
               {"messages": MESSAGES[-1:], "n": 3, "max_completion_tokens": 6, "seed": 5, "ignore_eos": True})
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert len({c["message"]["content"] for c in out["choices"]}) > 1   # each choice its own seed
    assert out["usage"]["completion_tokens"] == 18
    single = post(qk_server.url, "/v1/chat/completions",
                  {"messages": MESSAGES[-1:], "max_tokens": 6, "seed": 5, "ignore_eos": True})
    assert single["choices"][0]["message"]["content"] == out["choices"][0]["message"]["content"]
    # Streamed, every choice ends with its own finish chunk.
    r = requests.post(qk_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": MESSAGES[-1:], "n": 2, "max_tokens": 4, "stream": True, "ignore_eos": True})
    finished = [c["choices"][0]["index"] for c in sse_events(r)[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_logprobs(qk_server):
    out = post(qk_server.url, "/v1/chat/completions",
               {"messages": MESSAGES[-1:], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": True, "top_logprobs": 3})
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and entry["logprob"] <= 0
        # Greedy: the chosen token is the most likely one.
        assert entry["logprob"] == pytest.approx(tops[0]["logprob"]) and entry["token"] == tops[0]["token"]
        assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    text = bytes(b for e in content for b in e["bytes"]).decode("utf-8", "replace")  # random weights: stray bytes
    assert text == out["choices"][0]["message"]["content"]
    legacy = post(qk_server.url, "/v1/completions", {"prompt": "the cache", "max_tokens": 3, "temperature": 0,
                                                     "ignore_eos": True, "logprobs": 2})
    lp = legacy["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert lp["text_offset"][0] == 0 and all(len(d) <= 2 for d in lp["top_logprobs"])


def test_stop_strings_cut_the_text(qk_server):
    body = {"prompt": "the model", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = post(qk_server.url, "/v1/completions", body)["choices"][0]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert len(stop) == 2
    cut = post(qk_server.url, "/v1/completions", {**body, "stop": [stop, "never there"]})["choices"][0]
    assert cut["text"] == full[:full.index(stop)] and cut["finish_reason"] == "stop"
    one = post(qk_server.url, "/v1/completions", {**body, "stop": stop})["choices"][0]
    assert one["text"] == cut["text"]


def test_penalties_and_filters_change_sampling(qk_server):
    body = {"prompt": "the model", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    plain = post(qk_server.url, "/v1/completions", body)["choices"][0]["text"]
    penalised = post(qk_server.url, "/v1/completions", {**body, "presence_penalty": 2.0, "frequency_penalty": 2.0,
                                                        "repetition_penalty": 1.8})["choices"][0]["text"]
    assert penalised != plain
    # top_k 1 leaves one token to sample: greedy, whatever the temperature and seed.
    filtered = post(qk_server.url, "/v1/completions", {**body, "temperature": 1.5, "seed": 3, "top_k": 1})
    assert filtered["choices"][0]["text"] == plain
    kept = post(qk_server.url, "/v1/completions", {**body, "temperature": 1.5, "seed": 3, "min_p": 0.0})
    assert kept["choices"][0]["text"] != plain


def test_chat_page_is_served(qk_server):
    r = requests.get(qk_server.url + "/", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<html" in r.text.lower() and "v1/chat/completions" in r.text   # the page calls this server


def test_min_tokens_holds_back_a_stop_token(qk_server, chat_tokenizer):
    body = {"prompt": "the model", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    full = post(qk_server.url, "/v1/completions", body)["choices"][0]["text"]
    token = chat_tokenizer(full, add_special_tokens=False)["input_ids"][0]  # one of the answer's tokens
    stopped = post(qk_server.url, "/v1/completions", {**body, "stop_token_ids": [token]})
    at = stopped["usage"]["completion_tokens"]  # where it first comes
    assert stopped["choices"][0]["finish_reason"] == "stop" and at <= 6
    held = post(qk_server.url, "/v1/completions", {**body, "stop_token_ids": [token], "min_tokens": at + 2})
    assert held["usage"]["completion_tokens"] >= at + 2
    too_many = requests.post(qk_server.url + "/v1/completions", json={**body, "min_tokens": 9}, timeout=60)
    assert too_many.status_code == 400 and "min_tokens" in too_many.json()["error"]["message"]
