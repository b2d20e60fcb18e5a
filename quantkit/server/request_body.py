"""Reading a request: the raw body (so that GET with a JSON body, as some clients send, works like POST)
under `RequestLimits` (limits.py), then its model (protocol.py), every problem an `APIError`.

In order: a JSON Content-Type or none (else 415, which also keeps a web page from posting a form or
text/plain to a server without a key); at most `max_request_bytes` (413, by Content-Length before
reading, else while reading); UTF-8 JSON text (a RecursionError from deep nesting is a 400 too);
nesting at most `max_json_depth` deep; no lone surrogate escape; then pydantic, with the model's
vocabulary size and the limits in its validation context.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from quantkit.server.limits import RequestLimits
from quantkit.server.protocol import DEFAULT_LIMITS, APIError


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
        data = json.loads(body.decode("utf-8-sig"))   # JSON is UTF-8 (RFC 8259), a byte-order mark allowed
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
    if _may_hold_lone_surrogate(body):
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


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD]([89a-fA-F])[0-9a-fA-F]{2}")


def _may_hold_lone_surrogate(body: bytes) -> bool:
    """Whether a \\ud800-\\udfff escape is not half of a high-low pair: json.loads turns it into a lone
    surrogate, which no tokenizer encodes. (An escaped backslash before 'ud800' counts too: the walk
    that follows is exact.)"""
    pair_at = -1   # where the low half of the last high escape must start
    for m in _SURROGATE_ESCAPE.finditer(body):
        high = m.group(1) in b"89abAB"
        if pair_at >= 0:
            if m.start() != pair_at or high:
                return True
            pair_at = -1
        elif high:
            pair_at = m.end()
        else:
            return True
    return pair_at >= 0


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
    return part in ("str", "int", "float", "bool", "dict", "none") or \
        part.startswith(("list[", "dict[", "literal[", "ContentPart", "NamedToolChoice"))
