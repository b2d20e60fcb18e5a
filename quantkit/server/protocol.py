"""The OpenAI API as data: request models with their validation, OpenAI's error body, response pieces.

The models bound every value that reaches the engine to one it can hold (token ids in the vocabulary,
a 64-bit seed, finite floats, min_tokens within max_tokens) and count what `RequestLimits` caps
(prompts, messages, stop strings); the vocabulary size and the limits come in pydantic's validation
context (request_body.py reads and validates a request). Every problem becomes `APIError`, which the
app renders as `{"error": {"message", "type", "param", "code"}}` with its HTTP status. Unknown fields
are ignored (clients send `user`, `store`, `metadata`...); known fields with values the engine cannot
honour (logit_bias, echo...) are refused with a sentence that says so. Structured output comes as
OpenAI's `response_format`, vLLM's `structured_outputs` or its older `guided_*` fields (structured.py
turns them into the engine's grammar); tools as OpenAI's `tools` / `tool_choice` (tool_calls.py).
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
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
    if not ids or (min(ids) >= 0 and (vocab is None or max(ids) < vocab)):
        return
    bad = next(t for t in ids if t < 0 or (vocab is not None and t >= vocab))
    span = f"[0, {vocab})" if vocab is not None else "≥ 0"
    raise bound_error(f"{field} holds the token id {bad}; this model's token ids are {span}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None
    image_url: Union[str, dict, None] = None   # {"url": "data:image/png;base64,…" or a path}


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., min_length=1)
    arguments: Union[str, dict] = "{}"


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[MessageToolCall]] = None   # an assistant turn's calls
    tool_call_id: Optional[str] = None                    # a tool turn: the call it answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., min_length=1, max_length=256)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None   # a JSON schema of the arguments (None: any object)
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(..., min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` field: one of a JSON schema, a regex, a choice, an EBNF grammar, any
    JSON object, a structural tag."""

    model_config = ConfigDict(extra="ignore")
    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Union[dict[str, Any], str, None] = None   # XGrammar's {"type": "structural_tag", "format": …}


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
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


    @field_validator("top_k")
    @classmethod
    def _top_k_within_vocab(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        vocab = (info.context or {}).get("vocab_size")
        if value is not None and vocab is not None and value > vocab:
            raise bound_error(f"top_k {value} is more than this model's {vocab} tokens: use 1-{vocab}, "
                              "or -1 or 0 for no top-k")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_within_caps(cls, value: Any, info: ValidationInfo) -> Any:
        limits = _limits(info)
        stops = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        if len(stops) > limits.max_stop:
            raise bound_error(f"stop has {len(stops)} strings; this server takes at most {limits.max_stop} "
                              "(--max-stop)")
        longest = max((len(s) for s in stops if isinstance(s, str)), default=0)
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
    def _min_within_max(self) -> SamplingFields:
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
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_within_cap(cls, value: Any, info: ValidationInfo) -> Any:
        cap = _limits(info).max_messages
        if isinstance(value, list) and len(value) > cap:
            raise bound_error(f"messages has {len(value)} messages; this server takes at most {cap} "
                              "(--max-messages)")
        return value

    def check_supported(self) -> None:
        super().check_supported()
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise APIError(400, f"two tools are named {dup!r}: give each tool its own name", param="tools",
                           code="invalid_value")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools"
                           + (f" ({', '.join(map(repr, names))})" if names else " (none given)"),
                           param="tool_choice", code="invalid_value")
        if choice == "required" and not names:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice", code="invalid_value")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_new_tokens(self) -> Optional[int]:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    # list[int] before list[str]: a long token-id list then validates as one list, not as a failed list[str]
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts_within_cap(cls, value: Any, info: ValidationInfo) -> Any:
        """Counted before the items are validated, so that a long list costs nothing but its length. A list
        of ints is one token-id prompt."""
        cap = _limits(info).max_prompts_per_request
        if isinstance(value, list) and len(value) > cap and not all(type(t) is int for t in value):
            raise bound_error(f"prompt has {len(value)} prompts; this server takes at most {cap} per request "
                              "(--max-prompts-per-request)")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_ids_in_vocab(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, str):
            return value
        if value and isinstance(value[0], int):
            _check_token_ids(value, info, "prompt")
            return value
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


# --- responses --------------------------------------------------------------------------------------

def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(data: Union[dict, str]) -> bytes:
    """One server-sent event: `data: JSON` and a blank line."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = b"data: [DONE]\n\n"
