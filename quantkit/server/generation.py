"""One HTTP request's generation: its engine requests (prompts × n choices), their outputs as they
arrive, and the OpenAI answer built from them, streamed as server-sent events or whole.

A `Job` owns an asyncio queue that the engine loop's outputs land in, tagged with the choice index.
A client that disconnects puts `DISCONNECTED` in the same queue (the watcher reads the ASGI receive
channel), so a request waiting for its next token learns of it at once and aborts, freeing its KV
blocks. Outputs that arrived together are merged into one chunk per choice, so a slow reader gets
fewer, larger chunks instead of a growing backlog.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from quantkit.server.engine_loop import EngineClient
from quantkit.server.engine_requests import EngineFailure
from quantkit.server.metrics import ServerMetrics
from quantkit.server.protocol import DONE, APIError, sse, usage_dict
from quantkit.server.token_spelling import TokenSpelling

DISCONNECTED = object()


@dataclass
class Choice:
    """What one choice has received so far."""

    prompt: int                          # which of the request's prompts it answers
    prompt_tokens: int = 0               # as the engine counted them (image tokens included)
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    first_at: Optional[float] = None


@dataclass
class Delta:
    """Outputs of one choice merged: the new text, tokens, logprobs, and the finish reason once finished."""

    text: str
    num_tokens: int
    logprobs: list
    finish_reason: Optional[str]


class Job:
    def __init__(self, loop: EngineClient, metrics: ServerMetrics, endpoint: str, prompts: list[Any],
                 params: list[list[Any]], receive: Callable) -> None:
        """prompts[p] token ids (or a ChatWithImages); params[p][j] the SamplingParams of choice p·n + j."""
        self.loop, self.metrics, self.endpoint = loop, metrics, endpoint
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.arrival = time.perf_counter()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[Choice] = []
        self.rids: list[str] = []
        for p, prompt in enumerate(prompts):
            for sp in params[p]:
                index = len(self.choices)
                self.choices.append(Choice(p))
                rid = f"{self.id}-{index}"
                self.rids.append(rid)
                loop.add(rid, prompt, sp, lambda out, i=index: self.queue.put_nowait((i, out)))
        self.unfinished = set(range(len(self.choices)))
        self._prompt_tokens: dict[int, int] = {}   # prompt → its token count, from its first output
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Callable) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.queue.put_nowait((None, DISCONNECTED))
                return

    def close(self) -> None:
        """Abort the choices still running (the client left, or an error) and stop watching."""
        for i in self.unfinished:
            self.loop.abort(self.rids[i])
            self.metrics.requests[(self.endpoint, "abort")] += 1
        self.unfinished.clear()
        self._watcher.cancel()

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def prompt_tokens(self) -> int:
        """Each prompt's tokens once (the n choices of a prompt share them), as the engine counted them."""
        return sum(self._prompt_tokens.values())

    async def next_deltas(self) -> Optional[dict[int, Delta]]:
        """The outputs that have arrived (waiting for at least one), merged per choice; None when the
        client disconnected. An engine failure raises APIError."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        now = time.perf_counter()
        merged: dict[int, Delta] = {}
        for index, out in items:
            if out is DISCONNECTED:
                return None
            if isinstance(out, EngineFailure):
                self.unfinished.discard(index)
                self.metrics.requests[(self.endpoint, "error")] += 1
                raise APIError(out.status, out.message,
                               type="invalid_request_error" if out.user_error else "server_error",
                               headers={"Retry-After": str(out.retry_after)} if out.retry_after else None)
            choice = self.choices[index]
            if choice.prompt not in self._prompt_tokens:
                self._prompt_tokens[choice.prompt] = out.prompt_tokens
                self.metrics.prompt_tokens += out.prompt_tokens
            if choice.first_at is None and out.token_ids:
                choice.first_at = now
                self.metrics.ttft.observe(now - self.arrival)
            choice.num_tokens += len(out.token_ids)
            self.metrics.generation_tokens += len(out.token_ids)
            d = merged.setdefault(index, Delta("", 0, [], None))
            d.text += out.text
            d.num_tokens += len(out.token_ids)
            d.logprobs.extend(out.logprobs or [])
            if out.finished:
                d.finish_reason = choice.finish_reason = out.finish_reason
                self.unfinished.discard(index)
                self.metrics.requests[(self.endpoint, out.finish_reason)] += 1
                if choice.num_tokens > 1 and choice.first_at is not None:
                    self.metrics.tpot.observe((now - choice.first_at) / (choice.num_tokens - 1))
        return merged


class Renderer:
    """Builds the OpenAI bodies of one endpoint ("chat" or "completions") for a served model name."""

    def __init__(self, endpoint: str, model: str, spell: Callable[[int], TokenSpelling],
                 tool_calls: Optional[Callable[[], Any]] = None) -> None:
        """tool_calls: makes a choice's tool-call extractor (tool_calls.py) when the request has tools."""
        self.chat = endpoint == "chat"
        self.model, self.spell, self.tool_calls = model, spell, tool_calls
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        self.id_prefix = "chatcmpl-" if self.chat else "cmpl-"

    def logprobs(self, entries: list, offset: int = 0) -> Optional[dict]:
        """OpenAI's logprobs object for TokenLogprobs entries (chat: `content`; completions: the legacy
        parallel lists, text offsets counted in characters from `offset`). Tokens are spelled as the
        tokenizer spells them, with the bytes of text they stand for (token_spelling.py)."""
        if self.chat:
            def item(tid: int, lp: float) -> dict:
                token, data = self.spell(tid)
                return {"token": token, "logprob": lp, "bytes": data}
            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries]}
        tokens, offsets = [], []
        text = codecs.getincrementaldecoder("utf-8")("replace")  # a character split over tokens counts once
        for e in entries:
            token, data = self.spell(e.token_id)
            tokens.append(token)
            offsets.append(offset)
            offset += len(text.decode(bytes(data)))
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self.spell(t).token: lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def head(self, job: Job, obj: str) -> dict:
        return {"id": self.id_prefix + job.id, "object": obj, "created": job.created, "model": self.model}

    async def whole(self, job: Job, want_logprobs: bool) -> Optional[dict]:
        """The complete answer once every choice finished; None if the client disconnected first."""
        logprobs: dict[int, list] = {i: [] for i in range(len(job.choices))}
        while job.unfinished:
            deltas = await job.next_deltas()
            if deltas is None:
                return None
            for i, d in deltas.items():
                job.choices[i].text.append(d.text)
                logprobs[i].extend(d.logprobs)
        choices = []
        for i, c in enumerate(job.choices):
            text = "".join(c.text)
            lp = self.logprobs(logprobs[i]) if want_logprobs else None
            if self.chat and self.tool_calls is not None:
                extractor = self.tool_calls()
                found = extractor.feed(text)
                found += extractor.finish()
                calls = [{"id": d["id"], "type": "function", "function": d["function"]} for d in found.tool_calls]
                message = {"role": "assistant", "content": found.content if found.content.strip() or not calls
                           else None}
                if calls:
                    message["tool_calls"] = calls
                choices.append({"index": i, "message": message, "logprobs": lp,
                                "finish_reason": _finish_reason(c.finish_reason, calls)})
            elif self.chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                "finish_reason": c.finish_reason})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return {**self.head(job, self.object), "choices": choices,
                "usage": usage_dict(job.prompt_tokens, job.completion_tokens)}

    async def stream(self, job: Job, want_logprobs: bool, include_usage: bool,
                     continuous_usage: bool) -> AsyncIterator[bytes]:
        """The answer as server-sent events: (chat) a role chunk per choice, then text chunks, a finish
        chunk per choice, the usage chunk when asked, `[DONE]`. A failure (the request's own, or the
        engine's) ends the stream with an error event in OpenAI's error body, then `[DONE]`."""
        head = self.head(job, self.chunk_object)
        usage = None

        def chunk(index: int, body: dict, finish: Optional[str]) -> bytes:
            choice = {"index": index, **body, "logprobs": body.pop("logprobs", None), "finish_reason": finish}
            out = {**head, "choices": [choice]}
            if include_usage:
                out["usage"] = usage_dict(job.prompt_tokens, job.completion_tokens) if continuous_usage else None
            return sse(out)

        # The common chunk (text only, not finished) from a template: one json.dumps of the text per token.
        head_json = json.dumps(head, ensure_ascii=False, separators=(",", ":"))[:-1]
        key = '"delta":{"content":' if self.chat else '"text":'
        text_pre = [f'data: {head_json},"choices":[{{"index":{i},{key}' for i in range(len(job.choices))]
        text_post = ('}' if self.chat else '') + ',"logprobs":null,"finish_reason":null}]' + \
            (',"usage":null' if include_usage else "") + "}\n\n"
        fast = not want_logprobs and not continuous_usage and self.tool_calls is None
        extractors = [self.tool_calls() for _ in job.choices] if self.chat and self.tool_calls is not None else None
        called = [False] * len(job.choices)

        if self.chat:
            for i in range(len(job.choices)):
                yield chunk(i, {"delta": {"role": "assistant", "content": ""}}, None)
        offsets = [0] * len(job.choices)
        while job.unfinished:
            try:
                deltas = await job.next_deltas()
            except APIError as exc:
                yield sse(exc.body()) + DONE
                return
            if deltas is None:
                return
            parts = []
            for i, d in deltas.items():
                lp = self.logprobs(d.logprobs, offsets[i]) if want_logprobs and d.logprobs else None
                offsets[i] += len(d.text)
                if fast and d.text and not d.finish_reason:
                    parts.append((text_pre[i] + json.dumps(d.text, ensure_ascii=False) + text_post).encode())
                elif extractors is not None:
                    found = extractors[i].feed(d.text)
                    if d.finish_reason:
                        found += extractors[i].finish()
                    called[i] = called[i] or bool(found.tool_calls)
                    if found.content or lp:
                        parts.append(chunk(i, {"delta": {"content": found.content}, "logprobs": lp}, None))
                    if found.tool_calls:
                        parts.append(chunk(i, {"delta": {"tool_calls": found.tool_calls}}, None))
                    if d.finish_reason:
                        parts.append(chunk(i, {"delta": {}}, _finish_reason(d.finish_reason, called[i])))
                elif self.chat:
                    if d.text or lp:
                        parts.append(chunk(i, {"delta": {"content": d.text}, "logprobs": lp}, None))
                    if d.finish_reason:
                        parts.append(chunk(i, {"delta": {}}, d.finish_reason))
                elif d.text or lp or d.finish_reason:
                    parts.append(chunk(i, {"text": d.text, "logprobs": lp}, d.finish_reason))
            if parts:
                yield b"".join(parts)
        if include_usage:
            usage = usage_dict(job.prompt_tokens, job.completion_tokens)
            yield sse({**head, "choices": [], "usage": usage})
        yield DONE


def _finish_reason(reason: Optional[str], called: Any) -> Optional[str]:
    """"tool_calls" for an answer that ended by itself with calls in it (OpenAI's); else the engine's."""
    return "tool_calls" if called and reason == "stop" else reason
