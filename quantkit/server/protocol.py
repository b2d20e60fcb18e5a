"""The OpenAI API as data: request models with their validation, OpenAI's error body, response pieces.

Requests are parsed from the raw body (so that GET with a JSON body, as some clients send, works like
POST), validated by pydantic, and every problem becomes `APIError`, which the app renders as
`{"error": {"message", "type", "param", "code"}}` with its HTTP status. Unknown fields are ignored
(clients send `user`, `store`, `metadata`...); known fields with values the engine cannot honour
(tools, logit_bias, echo...) are refused with a sentence that says so.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None
    image_url: Union[str, dict, None] = None   # {"url": "data:image/png;base64,…" or a local path}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None


class SamplingFields(BaseModel):
    """The fields both endpoints take."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[str] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None

    def check_supported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server: leave it out", param="logit_bias",
                           code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Any]] = None
    response_format: Optional[dict[str, Any]] = None

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


def parse_request(body: bytes, model: type[BaseModel]) -> Any:
    """The request model from a raw JSON body; APIError 400 naming the field for anything wrong."""
    if not body.strip():
        raise APIError(400, "the request has no body: send a JSON object", code="invalid_json")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"the body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    request.check_supported()
    return request


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors()[0]
    loc = [str(p) for p in err["loc"]]
    # Union members add their own name to the path (`stop.str`): keep the request's field names only.
    param = ".".join(p for p in loc if not _is_type_name(p)) or None
    kind = err["type"]
    if kind == "missing":
        code, message = "missing_required_parameter", f"missing required parameter: {param}"
    else:
        code = "invalid_type" if kind.endswith(("_type", "_parsing")) or "union" in kind else "invalid_value"
        message = f"invalid value for {param}: {err['msg']} (got {err.get('input')!r})"
    return APIError(400, message, param=param, code=code)


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
