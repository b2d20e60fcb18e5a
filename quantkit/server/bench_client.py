"""One streamed request to an OpenAI-compatible server, timed (the client of `quantkit bench serve`).

TTFT is the time from sending the request to the first chunk that carries text; the latency is the
time to the end of the stream. Output tokens come from the stream's `usage` chunk when the server
sends one (`stream_options.include_usage`), else from the count of chunks with text, and the result
says which (`tokens_from`). A server that answers with one JSON body instead of a stream is timed the
same way, its TTFT being its latency.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp

from quantkit.server.bench_dataset import Prompt

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class RequestResult:
    ok: bool = False
    error: Optional[str] = None          # "HTTP 503: queue full", "timeout after 60s", ...
    ttft: Optional[float] = None         # seconds
    latency: Optional[float] = None      # seconds, request sent → stream ended
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None  # from usage, when the server sends it
    tokens_from: str = "chunks"          # "usage" or "chunks"
    text: str = ""

    @property
    def tpot(self) -> Optional[float]:
        """Seconds per output token after the first; None for a one-token answer."""
        if not self.ok or self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass
class Payload:
    """What every request of a run sends besides its prompt."""

    model: str
    endpoint: str = "chat"
    ignore_eos: bool = True
    include_usage: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, prompt: Prompt, max_tokens: Optional[int] = None) -> dict[str, Any]:
        n = max_tokens or prompt.output_len
        body: dict[str, Any] = {"model": self.model, "max_tokens": n, "temperature": 0.0, "stream": True}
        if self.endpoint == "chat":
            body["messages"] = prompt.messages or [{"role": "user", "content": prompt.prompt}]
        else:
            body["prompt"] = prompt.prompt
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body.update(ignore_eos=True, min_tokens=n)
        body.update(self.extra)
        return body


def base_url(url: str) -> str:
    """The server's root: 'http://h:p/v1/' and 'http://h:p' both give 'http://h:p'."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url


def headers(api_key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(status: int, body: str) -> str:
    """'HTTP 404: model x not found' from OpenAI's error body, or the body's first 200 characters."""
    msg = body.strip()
    try:
        obj = json.loads(body)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            msg = str(err.get("message") or err.get("detail") or err)
        elif isinstance(obj, dict) and "detail" in obj:
            msg = str(obj["detail"])
        else:
            msg = str(err)
    except (json.JSONDecodeError, AttributeError):
        pass
    msg = " ".join(msg.split())[:200]
    return f"HTTP {status}: {msg}" if msg else f"HTTP {status}"


def _text_of(choice: dict, endpoint: str) -> str:
    if endpoint == "chat":
        delta = choice.get("delta") or choice.get("message") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


async def send(session: aiohttp.ClientSession, url: str, body: dict, endpoint: str, timeout: float,
               hdrs: dict[str, str]) -> RequestResult:
    """POST `body` to `url`, read the event stream to its end, and time it. Never raises for a
    server's or the network's fault: the result carries the error instead."""
    res = RequestResult()
    start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=hdrs,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = error_message(resp.status, await resp.text())
                return res
            if "text/event-stream" in resp.headers.get("Content-Type", ""):
                await _read_stream(resp, res, endpoint, start)
            else:
                _read_body(json.loads(await resp.text()), res, endpoint)
                res.ttft = time.perf_counter() - start
    except asyncio.TimeoutError:
        res.error = f"timeout after {timeout:g}s"
        return res
    except aiohttp.ClientError as exc:
        res.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return res
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        res.error = f"bad response: {exc}"
        return res
    res.latency = time.perf_counter() - start
    if res.error is None:
        if res.output_tokens < 1:
            res.error = "no output tokens in the answer"
        else:
            res.ok = True
    return res


async def _read_stream(resp: aiohttp.ClientResponse, res: RequestResult, endpoint: str, start: float) -> None:
    chunks, parts = 0, []
    usage = None
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, ": comments", "event:" lines
        data = line[5:].strip()
        if data == "[DONE]":
            break
        obj = json.loads(data)
        if not isinstance(obj, dict):
            continue
        if obj.get("error"):
            err = obj["error"]
            res.error = "error in stream: " + str(err.get("message", err) if isinstance(err, dict) else err)
            return
        for choice in obj.get("choices") or []:
            text = _text_of(choice, endpoint)
            if text:
                if res.ttft is None:
                    res.ttft = time.perf_counter() - start
                chunks += 1
                parts.append(text)
        if obj.get("usage"):
            usage = obj["usage"]
    res.text = "".join(parts)
    _apply_usage(res, usage, chunks)


def _read_body(obj: Any, res: RequestResult, endpoint: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError("the answer is not a JSON object")
    if obj.get("error"):
        res.error = error_message(200, json.dumps(obj))
        return
    res.text = "".join(_text_of(c, endpoint) for c in obj.get("choices") or [])
    _apply_usage(res, obj.get("usage"), 1 if res.text else 0)


def _apply_usage(res: RequestResult, usage: Optional[dict], chunks: int) -> None:
    if usage and isinstance(usage.get("completion_tokens"), int):
        res.output_tokens, res.tokens_from = usage["completion_tokens"], "usage"
    else:
        res.output_tokens, res.tokens_from = chunks, "chunks"
    if usage and isinstance(usage.get("prompt_tokens"), int):
        res.prompt_tokens = usage["prompt_tokens"]


async def list_models(session: aiohttp.ClientSession, root: str, hdrs: dict[str, str], timeout: float) -> list[str]:
    """The ids of GET /v1/models."""
    async with session.get(root + "/v1/models", headers=hdrs, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        if r.status != 200:
            raise RuntimeError(error_message(r.status, await r.text()))
        data = await r.json(content_type=None)
    return [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
