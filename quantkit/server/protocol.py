"""The OpenAI API as data: request models with their validation, OpenAI's error body, response pieces.

Requests are read from the raw body (so that GET with a JSON body, as some clients send, works like
POST) under `RequestLimits` (limits.py): a JSON Content-Type or none (415), at most so many bytes (413),
nested at most so deep. pydantic validates them, with the model's vocabulary size in the validation
context, so that every value that reaches the engine is one it can hold (token ids in the vocabulary,
a 64-bit seed, finite floats). Every problem becomes `APIError`, which the app renders as
`{"error": {"message", "type", "param", "code"}}` with its HTTP status. Unknown fields are ignored
(clients send `user`, `store`, `metadata`...); known fields with values the engine cannot honour
(tools, logit_bias, echo...) are refused with a sentence that says so.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from quantkit.server.limits import RequestLimits

DEFAULT_LIMITS = RequestLimits()
MAX_TOKENS = 2**31     # max_tokens and min_tokens: far past any context, within what the engine's ints hold


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bound_error(message: str, param: Optional[str] = None) -> PydanticCustomError:
    """A validator's error whose message is said as is; `param` names the field where pydantic's location
    cannot (a check across fields)."""
    return PydanticCustomError("bound", message, {"param": param} if param else None)


def _limits(info: ValidationInfo) -> RequestLimits:
    return (info.context or {}).get("limits") or DEFAULT_LIMITS


def _check_token_ids(ids: list[int], info: ValidationInfo, field: str) -> None:
    """Every id in [0, vocab) (the vocabulary size comes in the validation context; without it, ≥ 0)."""
    vocab = (info.context or {}).get("vocab_size")
    for t in ids:
        if t < 0 or (vocab is not None and t >= vocab):
            span = f"[0, {vocab})" if vocab is not None else "≥ 0"
            raise bound_error(f"{field} holds the token id {t}; this model's token ids are {span}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None
    image_url: Union[str, dict, None] = None   # {"url": "data:image/png;base64,…" or a path}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class SamplingFields(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)      # -1 and 0: off; at most the vocabulary's size
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = Field(None, ge=-2**63, lt=2**64)   # what torch.Generator.manual_seed takes
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # Penalised logits are divided or multiplied by it: past these, they overflow float32 or vanish.
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=100)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    @property
    def max_new_tokens(self) -> Optional[int]:
        raise NotImplementedError

    @field_validator("top_k")
    @classmethod
    def _top_k_within_vocab(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        vocab = (info.context or {}).get("vocab_size")
        if value is not None and vocab is not None and value > vocab:
            raise bound_error(f"top_k {value} is more than this model's {vocab} tokens: use 1-{vocab}, "
                              "or -1 or 0 for no top-k")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_within_caps(cls, value: Union[str, list[str], None], info: ValidationInfo) -> Any:
        limits = _limits(info)
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > limits.max_stop:
            raise bound_error(f"stop has {len(stops)} strings; this server takes at most {limits.max_stop} "
                              "(--max-stop)")
        longest = max(map(len, stops), default=0)
        if longest > limits.max_stop_chars:
            raise bound_error(f"a stop string has {longest} characters; this server takes at most "
                              f"{limits.max_stop_chars} (--max-stop-chars)")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_in_vocab(cls, value: Optional[list[int]], info: ValidationInfo) -> Optional[list[int]]:
        _check_token_ids(value or [], info, "stop_token_ids")
        return value

    @model_validator(mode="after")
    def _min_within_max(self) -> "SamplingFields":
        limit = self.max_new_tokens
        if limit is not None and self.min_tokens > limit:
            raise bound_error(f"min_tokens {self.min_tokens} is more than the {limit} tokens asked for at most: "
                              "lower min_tokens", param="min_tokens")
        return self

    def check_supported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server: leave it out", param="logit_bias",
                           code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None

    @field_validator("messages")
    @classmethod
    def _messages_within_cap(cls, value: list[ChatMessage], info: ValidationInfo) -> list[ChatMessage]:
        cap = _limits(info).max_messages
        if len(value) > cap:
            raise bound_error(f"messages has {len(value)} messages; this server takes at most {cap} "
                              "(--max-messages)")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported by this server", param="tools",
                           code="unsupported_parameter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format other than text is not supported by this server",
                           param="response_format", code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("prompt")
    @classmethod
    def _prompts_within_caps(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            return value
        if value and isinstance(value[0], int):
            _check_token_ids(value, info, "prompt")
            return value
        cap = _limits(info).max_prompts_per_request
        if len(value) > cap:
            raise bound_error(f"prompt has {len(value)} prompts; this server takes at most {cap} per request "
                              "(--max-prompts-per-request)")
        for p in value:
            if isinstance(p, list):
                _check_token_ids(p, info, "prompt")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo", code="unsupported_parameter")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported by this server", param="suffix",
                           code="unsupported_parameter")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported by this server", param="best_of",
                           code="unsupported_parameter")

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_tokens

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts as a list: one string or token-id list each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]
        return list(p)


# --- reading a request -------------------------------------------------------------------------------

def check_content_type(value: Optional[str]) -> None:
    """A body is JSON: no Content-Type (parsed as JSON, as FastAPI does), application/json, or a `+json`
    type; anything else (a web page's form or text/plain POST) is 415."""
    mime = (value or "").split(";", 1)[0].strip().lower()
    if not mime or mime == "application/json" or ("/" in mime and mime.endswith("+json")):
        return
    raise APIError(415, f"the body must be JSON sent as 'Content-Type: application/json' (this request says "
                   f"{_short(repr(value))}); with curl: -H 'Content-Type: application/json'",
                   code="unsupported_media_type")


async def read_body(request: Any, limits: RequestLimits = DEFAULT_LIMITS) -> bytes:
    """A Starlette request's body, refused (413) past `limits.max_request_bytes` by its Content-Length
    before anything is read, else while it is read chunk by chunk, so that no huge body is held whole."""
    check_content_type(request.headers.get("content-type"))
    limit = limits.max_request_bytes
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this server's {limit} bytes: send less, or start the "
                    "server with a larger --max-request-bytes", code="request_too_large",
                    headers={"Connection": "close"})


def parse_request(body: bytes, model: type[BaseModel], limits: RequestLimits = DEFAULT_LIMITS,
                  vocab_size: Optional[int] = None) -> Any:
    """The request model from a raw JSON body; APIError 400 naming the field for anything wrong. Token ids
    are checked against `vocab_size` when given."""
    if not body.strip():
        raise APIError(400, "the request has no body: send a JSON object", code="invalid_json")
    too_deep = APIError(400, f"the body nests arrays and objects more than {limits.max_json_depth} deep "
                        "(--max-json-depth)", code="invalid_json")
    try:
        data = json.loads(body)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:   # JSONDecodeError, UnicodeDecodeError, or Python's cap on an int's digits
        reason = str(exc) if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)) else \
            "a number has thousands of digits"
        raise APIError(400, f"the body is not valid JSON ({_short(reason)})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    if body.count(b"[") + body.count(b"{") > limits.max_json_depth and _nests_deeper(body, limits.max_json_depth):
        raise too_deep
    if _LONE_SURROGATE.search(body):
        _check_unicode(data)
    try:
        request = model.model_validate(data, context={"limits": limits, "vocab_size": vocab_size})
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check_supported()
    return request


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _nests_deeper(body: bytes, max_depth: int) -> bool:
    """Whether a valid JSON text nests arrays and objects more than `max_depth` deep, by its brackets
    outside strings (innermost pairs removed once per level), without walking the parsed value."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKETS).replace(b"{", b"[").replace(b"}", b"]")
    for _ in range(max_depth):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


# json.loads turns an unpaired "\ud800" escape into a lone surrogate, which no tokenizer encodes.
_LONE_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])|"
                             rb"(?<![0-9a-fA-F]{4})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _check_unicode(data: Any) -> None:
    """400 naming the field of a string that holds a lone surrogate. The walk keeps one iterator per
    level (the depth is already bounded), not one entry per value."""
    stack = [("", iter(data.items()))]
    while stack:
        entry = next(stack[-1][1], None)
        if entry is None:
            stack.pop()
            continue
        key, value = entry
        if isinstance(value, (dict, list)):
            stack.append((str(key), iter(value.items() if isinstance(value, dict) else enumerate(value))))
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                path = ".".join([k for k, _ in stack[1:]] + [str(key)])
                raise APIError(400, "a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                               "escape): send valid Unicode", param=path, code="invalid_value") from None


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # Union members add their own name to the path (`stop.str`): keep the request's field names only.
    param = (err.get("ctx") or {}).get("param") or ".".join(p for p in loc if not _is_type_name(p)) or None
    kind = err["type"]
    if kind == "missing":
        code, message = "missing_required_parameter", f"missing required parameter: {param}"
    elif kind == "bound":
        code, message = "invalid_value", err["msg"]
    else:
        code = "invalid_type" if kind.endswith(("_type", "_parsing")) or "union" in kind else "invalid_value"
        message = f"invalid value for {param}: {err['msg']} (got {_short(repr(err.get('input')))})"
    return APIError(400, message, param=param, code=code)


def _short(text: str, limit: int = 120) -> str:
    """text cut to `limit` characters: errors quote what was sent, not megabytes of it."""
    return text if len(text) <= limit else text[:limit] + "…"


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "dict", "none") or part.startswith(("list[", "ContentPart"))


# --- responses --------------------------------------------------------------------------------------

def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: Union[dict, str]) -> bytes:
    """One server-sent event: `data: JSON` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = b"data: [DONE]\n\n"
