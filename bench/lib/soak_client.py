"""How `bench.soak`'s clients send a request (bench/lib/soak_requests.py's Spec) and what they saw.

A valid request is read to its end and checked: a stream must end with `data: [DONE]` after a finish
reason for every choice, a whole answer must carry every choice. A leaving client reads a few events
of its stream and closes the connection, or closes it before any answer arrives. An error event inside
a 200 stream counts as a server error, like a 5xx."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Callable, Optional

import aiohttp

from bench.lib.soak_requests import Spec
from quantkit.server.bench_client import error_message


@dataclass
class Result:
    kind: str                         # the Spec's kind and name
    name: str
    started: float                    # seconds into the run
    ended: float = 0.0
    status: Optional[int] = None      # None: no HTTP answer (left first, or the connection failed)
    complete: bool = False            # valid: the whole answer came; leave: the client left as planned
    server_error: bool = False        # a 5xx, or an error event inside a 200 stream
    retry_after: bool = False         # the answer had a Retry-After header
    message: str = ""

    @property
    def latency(self) -> float:
        return self.ended - self.started


class Client:
    """Sends Specs over one aiohttp session; `clock()` is seconds into the run."""

    def __init__(self, session: aiohttp.ClientSession, root: str, headers: dict[str, str], timeout: float,
                 clock: Callable[[], float]) -> None:
        self.session, self.root, self.headers = session, root, headers
        self.timeout, self.clock = timeout, clock

    async def send(self, spec: Spec) -> Result:
        res = Result(spec.kind, spec.name, self.clock())
        try:
            if spec.leave_delay is not None:
                await self._leave_early(spec, res)
            else:
                await asyncio.wait_for(self._exchange(spec, res), self.timeout)
        except asyncio.TimeoutError:
            res.message = f"no answer within {self.timeout:g} s"
        except (aiohttp.ClientError, OSError) as exc:
            res.message = f"{type(exc).__name__}: {exc}"
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            res.message = f"malformed answer: {type(exc).__name__}: {exc}"
        if spec.kind == "invalid" and res.status is not None and res.status < 400:
            res.message = f"accepted {spec.body[:160]!r}"
        res.ended = self.clock()
        return res

    def _post(self, spec: Spec):
        return self.session.post(self.root + spec.path, data=spec.body,
                                 headers={**self.headers, "Content-Type": spec.content_type})

    async def _exchange(self, spec: Spec, res: Result) -> None:
        async with self._post(spec) as resp:
            if not await self._status(resp, res):
                return
            if spec.stream and "text/event-stream" in resp.headers.get("Content-Type", ""):
                await self._read_stream(resp, spec, res)
                if spec.leave_after is not None:
                    resp.close()   # leaving: drop the connection
            else:
                self._check_whole(json.loads(await resp.read()), spec, res)

    async def _leave_early(self, spec: Spec, res: Result) -> None:
        """Close the connection after `leave_delay` seconds; an answer that comes first is closed at once."""
        async def until_status() -> None:
            async with self._post(spec) as resp:
                if await self._status(resp, res):
                    res.complete, res.message = True, "answered before the client left"
                resp.close()

        try:
            await asyncio.wait_for(until_status(), spec.leave_delay)
        except asyncio.TimeoutError:   # the request is cancelled and its connection closed
            res.complete = True

    async def _status(self, resp: aiohttp.ClientResponse, res: Result) -> bool:
        """Record the status; False (with the error read) when it is not 200."""
        res.status = resp.status
        res.retry_after = "Retry-After" in resp.headers
        if resp.status == 200:
            return True
        res.message = error_message(resp.status, await resp.text(errors="replace"))
        res.server_error = resp.status >= 500
        return False

    async def _read_stream(self, resp: aiohttp.ClientResponse, spec: Spec, res: Result) -> None:
        finished: set[int] = set()
        events = 0
        async for raw in resp.content:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                res.complete = len(finished) == spec.choices
                if not res.complete:
                    res.message = f"[DONE] after {len(finished)} of {spec.choices} choices finished"
                return
            obj = json.loads(data)
            if obj.get("error"):
                res.server_error = True
                res.message = "error event: " + error_message(200, data).removeprefix("HTTP 200: ")
                return
            finished.update(c["index"] for c in obj.get("choices") or [] if c.get("finish_reason"))
            events += 1
            if spec.leave_after is not None and events >= spec.leave_after:
                res.complete = True
                return
        res.message = "the stream ended without data: [DONE]"

    def _check_whole(self, obj: dict, spec: Spec, res: Result) -> None:
        if obj.get("error"):
            res.server_error = True
            res.message = error_message(200, json.dumps(obj))
            return
        choices = obj["choices"]
        res.complete = len(choices) == spec.choices and all(c.get("finish_reason") for c in choices)
        if not res.complete:
            res.message = f"{len(choices)} choices (of {spec.choices}) in the answer, or one without finish_reason"

    async def probe(self, body: dict, timeout: float) -> tuple[Optional[int], Optional[dict]]:
        """One request outside the traffic (model, prompt length, recovery): its status and JSON."""
        try:
            async with self.session.post(self.root + "/v1/completions" if "prompt" in body else
                                         self.root + "/v1/chat/completions", json=body, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status, (await resp.json(content_type=None) if resp.status == 200 else None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, json.JSONDecodeError):
            return None, None
