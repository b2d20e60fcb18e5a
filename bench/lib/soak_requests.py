"""What `bench.soak` sends: request i of a run is a pure function of (seed, i), so a seed replays the same
traffic whatever the timing. Six in ten requests are valid (either endpoint, streamed or not, random
prompt lengths and sampling settings within their ranges), two in ten are invalid (each must be answered
4xx), two in ten are valid requests whose client leaves: after a few chunks of the stream, or before
any answer arrives."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Optional

from quantkit.server.bench_dataset import WORDS

PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MIX = "vvivlvvilv"          # kinds by i % 10: v valid, i invalid, l the client leaves
DROP = object()             # an override that removes the field
INF, NAN = float("inf"), float("nan")

# Invalid by their fields: each alternative overrides a small valid body (DROP removes a field).
INVALID_FIELDS: dict[str, list[dict[str, Any]]] = {
    "wrong-type": [{"max_tokens": "ten"}, {"max_tokens": [4]}, {"temperature": "hot"}, {"stream": {"on": 1}},
                   {"stop": 5}, {"n": 1.5}, {"seed": "s"}, {"messages": "hi"}, {"messages": [1, 2]},
                   {"prompt": {"p": 1}}, {"prompt": 3.5}, {"stop_token_ids": "2"}],
    "out-of-range": [{"temperature": -0.5}, {"top_p": 0}, {"top_p": 1.5}, {"n": 0}, {"n": 65}, {"max_tokens": 0},
                     {"max_tokens": -3}, {"presence_penalty": 3}, {"frequency_penalty": -2.5}, {"min_p": 1.5},
                     {"top_k": -2}, {"repetition_penalty": 0}, {"top_logprobs": 21, "logprobs": True},
                     {"logprobs": 21}],
    "huge-int": [{"top_k": 2**70}, {"seed": 2**70}, {"seed": -(2**70)}, {"stop_token_ids": [2**70]},
                 {"stop_token_ids": [-7], "min_tokens": 2}, {"stop_token_ids": [2**40], "min_tokens": 2},
                 {"n": 2**64}, {"prompt": [2**40, 5]}, {"logprobs": 2**64},
                 {"top_logprobs": 2**64, "logprobs": True}],
    "non-finite": [{"temperature": INF}, {"top_p": NAN}, {"presence_penalty": NAN}, {"repetition_penalty": INF},
                   {"min_p": NAN}],
    "min-over-max": [{"max_tokens": 4, "min_tokens": 9}, {"max_tokens": 2, "min_tokens": 2**70}],
    "unknown-model": [{"model": "no-such-model"}],
    "missing-field": [{"messages": DROP}, {"prompt": DROP}, {"messages": []}, {"prompt": []},
                      {"messages": [{"role": "wizard", "content": "hi"}]}, {"messages": [{"content": "hi"}]}],
    # tools and response_format are served (issue #37): a tool without a name and a schema of an unknown
    # type are what the server must still refuse
    "unsupported": [{"logit_bias": {"5": 1.0}}, {"tools": [{"type": "function", "function": {"description": "f"}}]},
                    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
                    {"echo": True}, {"suffix": "x"}, {"best_of": 3}],
}
CHAT_ONLY = {"messages", "tools", "response_format", "top_logprobs"}
COMPLETIONS_ONLY = {"prompt", "echo", "suffix", "best_of", "logprobs"}
# Invalid as bodies: not JSON, not an object, nested past any parser's depth, or not sent as JSON.
BAD_BODIES = {
    "bad-json": [b'{"model": "m", "messages": [', b"{'single': 'quotes'}", b'{"a": 1,}', b"\xff\xfe\x00garbage",
                 b"", b"   "],
    "not-an-object": [b"[1, 2, 3]", b'"text"', b"42", b"null"],
}
DEEP_JSON = (2_000, 20_000, 100_000)
WRONG_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x")


@dataclass(frozen=True)
class Spec:
    """One request: where, what bytes, and how its client behaves."""

    kind: str                              # "valid", "invalid" or "leave"
    name: str                              # "chat-stream", "huge-int", "leave-mid-stream", ...
    path: str
    body: bytes
    content_type: str = "application/json"
    stream: bool = False
    choices: int = 1                       # choices a complete valid answer carries
    leave_after: Optional[int] = None      # leave-mid-stream: events read before leaving
    leave_delay: Optional[float] = None    # leave-before-answer: seconds before leaving


@dataclass(frozen=True)
class Traffic:
    """The run's request generator: the model, the context, how long prompts and answers may be."""

    model: str
    max_model_len: Optional[int]  # the server's context in tokens, if it says (/v1/models max_model_len)
    prompt_words: int             # most words in a valid prompt (fitted to --max-prompt-tokens)
    max_tokens: int               # most output tokens a valid request asks for
    seed: int = 0

    def spec(self, i: int) -> Spec:
        rng = random.Random(f"{self.seed}:{i}")
        kind = MIX[i % len(MIX)]
        if kind == "i":
            return self.invalid(rng)
        if kind == "l":
            return self.leaving(rng)
        return self.valid(rng)

    # --- valid --------------------------------------------------------------------------------------------

    def body(self, rng: random.Random, endpoint: str, stream: bool) -> tuple[dict[str, Any], int]:
        """A valid body and the number of choices its answer has."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(1, self.max_tokens), "stream": stream}
        prompts = 1
        if endpoint == "chat":
            body["messages"] = messages(rng, self.words(rng))
        elif rng.random() < 0.15:
            prompts = 2
            body["prompt"] = [text(rng, self.words(rng)) for _ in range(prompts)]
        else:
            body["prompt"] = text(rng, self.words(rng))
        sampling = {
            "temperature": lambda: rng.choice([0.0, round(rng.uniform(0.1, 1.5), 3)]),
            "top_p": lambda: round(rng.uniform(0.05, 1.0), 3), "top_k": lambda: rng.choice([-1, 0, 1, 5, 40]),
            "min_p": lambda: round(rng.uniform(0.0, 0.2), 3), "seed": lambda: rng.randrange(2**32),
            "stop": lambda: rng.sample(WORDS, rng.randint(1, 3)), "n": lambda: rng.randint(2, 3),
            "presence_penalty": lambda: round(rng.uniform(-1, 1), 3),
            "frequency_penalty": lambda: round(rng.uniform(-1, 1), 3),
            "repetition_penalty": lambda: round(rng.uniform(0.9, 1.2), 3),
        }
        for name, draw in sampling.items():
            if rng.random() < 0.3:
                body[name] = draw()
        if rng.random() < 0.2:
            body.update({"logprobs": True, "top_logprobs": rng.randint(0, 5)} if endpoint == "chat"
                        else {"logprobs": rng.randint(0, 5)})
        if rng.random() < 0.25:
            body["ignore_eos"] = True
            if rng.random() < 0.5:
                body["min_tokens"] = rng.randint(0, body["max_tokens"])
        if stream and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return body, prompts * body.get("n", 1)

    def words(self, rng: random.Random) -> int:
        return max(1, round(self.prompt_words * rng.random() ** 2))   # mostly short, some near the cap

    def valid(self, rng: random.Random) -> Spec:
        endpoint = "chat" if rng.random() < 0.6 else "completions"
        stream = rng.random() < 0.5
        body, choices = self.body(rng, endpoint, stream)
        return Spec("valid", f"{endpoint}-{'stream' if stream else 'whole'}", PATHS[endpoint], encode(body),
                    stream=stream, choices=choices)

    def leaving(self, rng: random.Random) -> Spec:
        endpoint = "chat" if rng.random() < 0.6 else "completions"
        if rng.random() < 0.5:
            body, choices = self.body(rng, endpoint, True)
            body.update(max_tokens=max(body["max_tokens"], 8), ignore_eos=True)   # long enough to leave inside
            return Spec("leave", "leave-mid-stream", PATHS[endpoint], encode(body), stream=True, choices=choices,
                        leave_after=rng.randint(1, 4))
        stream = rng.random() < 0.5
        body, choices = self.body(rng, endpoint, stream)
        return Spec("leave", "leave-before-answer", PATHS[endpoint], encode(body), stream=stream, choices=choices,
                    leave_delay=round(rng.uniform(0.0, 0.2), 3))

    # --- invalid ------------------------------------------------------------------------------------------

    def invalid(self, rng: random.Random) -> Spec:
        name = rng.choice([*INVALID_FIELDS, *BAD_BODIES, "deep-json", "content-type", "too-long-prompt"])
        endpoint = rng.choice(list(PATHS))
        if name in INVALID_FIELDS:
            override = rng.choice(INVALID_FIELDS[name])
            endpoint = ("chat" if CHAT_ONLY & override.keys() else
                        "completions" if COMPLETIONS_ONLY & override.keys() else endpoint)
            body = {**self.small(rng, endpoint), **override}
            return Spec("invalid", name, PATHS[endpoint], encode({k: v for k, v in body.items() if v is not DROP}))
        if name in BAD_BODIES:
            return Spec("invalid", name, PATHS[endpoint], rng.choice(BAD_BODIES[name]))
        if name == "deep-json":
            depth, opener = rng.choice(DEEP_JSON), rng.choice([b"[", b'{"a":'])
            return Spec("invalid", name, PATHS[endpoint], opener * depth)
        if name == "content-type":
            return Spec("invalid", name, PATHS[endpoint], encode(self.small(rng, endpoint)),
                        content_type=rng.choice(WRONG_TYPES))
        # Longer than the context: every word is at least one token.
        n = (self.max_model_len or 8_000) + 64
        body = self.small(rng, endpoint)
        body.update({"messages": messages(rng, n)} if endpoint == "chat" else {"prompt": text(rng, n)})
        return Spec("invalid", name, PATHS[endpoint], encode(body))

    def small(self, rng: random.Random, endpoint: str) -> dict[str, Any]:
        """A short valid body, the base an invalid field goes into."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": 4}
        if endpoint == "chat":
            body["messages"] = [{"role": "user", "content": text(rng, 5)}]
        else:
            body["prompt"] = text(rng, 5)
        return body


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_words)))


def messages(rng: random.Random, n_words: int) -> list[dict[str, str]]:
    """1-4 turns that end with the user's, an optional system prompt first; `n_words` words in all."""
    turns = rng.randint(1, 3) * 2 - 1
    roles = (["system"] if rng.random() < 0.3 else []) + ["user", "assistant"] * (turns // 2) + ["user"]
    if n_words < len(roles):
        sizes = [1] * len(roles)
    else:
        cuts = sorted(rng.sample(range(1, n_words), len(roles) - 1))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n_words])]
    return [{"role": r, "content": text(rng, s)} for r, s in zip(roles, sizes)]


def encode(body: dict[str, Any]) -> bytes:
    """JSON as a client would send it; NaN and Infinity written as Python's json writes them."""
    return json.dumps(body).encode()
