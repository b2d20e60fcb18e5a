"""The clients users point at OpenAI-compatible servers, unchanged: the seed's `requests` (GET with a JSON
body, read with raw._fp.read1()) and `aiohttp` (GET with json=, read with content.iter_any()), and the
official `openai` package, sync, async and streaming. Each gets the text the server's whole answer has."""

from __future__ import annotations

import asyncio
import json
import time

import requests

from quantkit_testing.serve_process import SERVED_NAME

BODY = {"model": SERVED_NAME, "messages": [{"role": "user", "content": "the cache keeps keys and values"}],
        "max_tokens": 10, "temperature": 0.8, "seed": 21, "ignore_eos": True}


def whole_text(url: str) -> str:
    r = requests.post(url + "/v1/chat/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def stream_text(raw: bytes) -> str:
    """The content of a chat stream's events; checks the framing (`data: ` events, `[DONE]` last)."""
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)


def test_requests_get_stream_read1(qk_server):
    """The seed's client: requests.get(..., stream=True, json=...), bytes read as they arrive with read1()."""
    response = requests.get(qk_server.url + "/v1/chat/completions", stream=True, json={**BODY, "stream": True},
                            timeout=60)
    assert response.status_code == 200
    pieces: list[bytes] = []
    deadline = time.monotonic() + 60
    for _ in range(10_000):                  # bounded: one read per event at most, plus the end
        chunk = response.raw._fp.read1()
        if not chunk:
            break
        pieces.append(chunk)
        assert time.monotonic() < deadline
    assert len(pieces) > 2                   # streamed in pieces, not one body
    assert stream_text(b"".join(pieces)) == whole_text(qk_server.url)


def test_aiohttp_get_iter_any(qk_server):
    import aiohttp

    async def run() -> bytes:
        pieces = []
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(qk_server.url + "/v1/chat/completions", json={**BODY, "stream": True}) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_any():
                    pieces.append(chunk)
        return b"".join(pieces)

    assert stream_text(asyncio.run(run())) == whole_text(qk_server.url)


def _openai(url: str, asynchronous: bool = False):
    import openai

    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _args() -> dict:
    return dict(model=SERVED_NAME, messages=BODY["messages"], max_tokens=BODY["max_tokens"],
                temperature=BODY["temperature"], seed=BODY["seed"], extra_body={"ignore_eos": True})


def test_openai_sync(qk_server):
    client = _openai(qk_server.url)
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    out = client.chat.completions.create(**_args())
    assert out.choices[0].message.content == whole_text(qk_server.url)
    assert out.usage.completion_tokens == BODY["max_tokens"] and out.choices[0].finish_reason == "length"
    legacy = client.completions.create(model=SERVED_NAME, prompt="the model", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert legacy.usage.completion_tokens == 4 and isinstance(legacy.choices[0].text, str)


def test_openai_streaming_with_usage(qk_server):
    client = _openai(qk_server.url)
    stream = client.chat.completions.create(**_args(), stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole_text(qk_server.url)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == BODY["max_tokens"]
    legacy = list(client.completions.create(model=SERVED_NAME, prompt="the model", max_tokens=4, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert legacy[-1].choices[0].finish_reason == "length"


def test_openai_async_concurrent(qk_server):
    async def run() -> list[str]:
        client = _openai(qk_server.url, asynchronous=True)
        try:
            outs = await asyncio.gather(*[client.chat.completions.create(**_args()) for _ in range(4)])

            async def streamed() -> str:
                parts = []
                async for c in await client.chat.completions.create(**_args(), stream=True):
                    parts.append(c.choices[0].delta.content or "")
                return "".join(parts)

            return [o.choices[0].message.content for o in outs] + [await streamed()]
        finally:
            await client.close()

    texts = asyncio.run(run())
    # Batched together or not, the seeded answers are the same.
    assert texts == [whole_text(qk_server.url)] * 5
