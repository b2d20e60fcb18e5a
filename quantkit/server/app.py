"""The FastAPI app: OpenAI's routes over one engine backend (engine_loop.py), the chat page, health, metrics.

    GET  /                      the chat page (static/chat.html)
    GET  /health                200 while the engine runs, 503 once it failed
    GET  /metrics               Prometheus text (metrics.py)
    GET  /v1/models             the served model
    POST /v1/chat/completions   chat: the tokenizer's chat template, streamed (SSE) or whole; image_url parts
                                (a data: URL, or a path under --allowed-local-media-path) for a model with a
                                vision tower (LLaVA)
    POST /v1/completions        text or token-id prompts, streamed or whole

The /v1 generation routes take GET with a JSON body too (some clients send that). Bodies are parsed
here, not by FastAPI, so that every problem is answered in OpenAI's error body.
"""

from __future__ import annotations

import hmac
import importlib.resources
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from quantkit.config import UserError
from quantkit.engine.config import SamplingParams
from quantkit.engine.images import ImagePolicy
from quantkit.engine.llm_engine import encode_chat
from quantkit.server.engine_loop import EngineClient, EngineLoop
from quantkit.server.engine_requests import ChatWithImages
from quantkit.server.generation import Job, Renderer
from quantkit.server.metrics import ServerMetrics
from quantkit.server.limits import RequestLimits
from quantkit.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from quantkit.server.request_body import parse_request, read_body
from quantkit.server.structured import GrammarChecker, requested_grammar
from quantkit.server.token_spelling import TokenSpeller
from quantkit.server.tool_calls import ToolPlan, detect_parser, plan_tools, template_messages

log = logging.getLogger(__name__)


@dataclass
class AppSettings:
    """What the HTTP side needs besides the engine."""

    served_model_name: str
    model_aliases: Sequence[str] = ()     # other names accepted in `model` (the MODEL argument as given)
    api_key: Optional[str] = None
    max_queue: int = 512                  # requests waiting beyond the engine's batch before 429
    allow_origins: Sequence[str] = ()     # CORS origins (a chat page served elsewhere)
    # image parts: data: URLs; local files only under --allowed-local-media-path; sizes capped
    images: ImagePolicy = field(default_factory=ImagePolicy.served)
    limits: RequestLimits = field(default_factory=RequestLimits)   # body bytes, prompts, messages, stops
    tool_call_parser: Optional[str] = None   # how `auto` tool calls are read (None: from the chat template)


class EventStream(Response):
    """text/event-stream from an async iterator of bytes; `on_close` runs however the stream ends."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(media_type="text/event-stream")
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:   # the client went away while we wrote
            pass
        finally:
            self.on_close()
            await self.chunks.aclose()


class Server:
    """The app's state: the engine's backend and what it told of the engine, the settings, the counters."""

    def __init__(self, backend: EngineClient, settings: AppSettings) -> None:
        self.loop, self.info, self.settings = backend, backend.info, settings
        self.metrics = ServerMetrics()
        self.names = {settings.served_model_name, *settings.model_aliases}
        self.tokenizer = self.info.tokenizer
        self.spell_token = TokenSpeller(self.tokenizer)   # logprobs' `token` and `bytes` of an id
        self.grammars = GrammarChecker(self.tokenizer, self.info.vocab_size, settings.limits)
        self.tool_parser = settings.tool_call_parser or detect_parser(
            getattr(self.tokenizer, "chat_template", None))

    # --- checks ---------------------------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if not key:
            return
        header = request.headers.get("authorization")
        if not header:
            raise APIError(401, "no API key given: send the header 'Authorization: Bearer KEY'",
                           code="invalid_api_key")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model not in self.names:
            raise APIError(404, f"the model {model!r} does not exist: this server serves "
                           f"{self.settings.served_model_name!r}", param="model", code="model_not_found")

    def check_capacity(self, num_sequences: int) -> None:
        if not self.loop.alive:
            retry = self.loop.retry_after
            raise APIError(503, f"the engine is not running ({self.loop.error or self.loop.state})"
                           + ("; it is restarting: retry in a few seconds" if retry else ""), type="server_error",
                           headers={"Retry-After": str(retry)} if retry else None)
        limit = self.info.max_num_seqs + self.settings.max_queue
        if num_sequences > limit:
            raise APIError(400, f"this request needs {num_sequences} sequences but the server holds at most "
                           f"{limit} (--max-num-seqs + --max-queue): lower n", param="n")
        if self.loop.num_in_flight + num_sequences > limit:
            self.metrics.rejected_queue_full += 1
            raise APIError(429, f"the server's queue is full ({self.loop.num_in_flight} sequences in flight, "
                           f"at most {limit}): retry later", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})

    # --- tokens ---------------------------------------------------------------------------------------

    def encode_messages(self, req: ChatCompletionRequest, tools: Optional[list[dict]] = None) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        messages = template_messages(req)
        try:
            return encode_chat(self.tokenizer, messages, tools)
        except Exception as exc:  # jinja's TemplateError and the templates' own raise_exception
            if type(exc).__name__ not in ("TemplateError", "TemplateSyntaxError", "UndefinedError") and \
                    not isinstance(exc, (ValueError, TypeError)):
                raise
            raise APIError(400, f"the model's chat template refused these messages: {exc}",
                           param="messages") from None

    def encode_image_messages(self, req: ChatCompletionRequest) -> ChatWithImages:
        """Messages with image_url parts (a data: URL each, or a local file path under the server's
        --allowed-local-media-path; nothing is downloaded), for the engine's vision tower, which reads them
        under `settings.images`. A model without one: 400."""
        if not self.info.has_vision:
            raise APIError(400, "this model takes no images (it has no vision tower): send text content only",
                           param="messages", code="unsupported_parameter")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = [{"type": "image_url", "image_url": {"url": _image_url(p.image_url)}}
                           if p.type == "image_url" else {"type": p.type, "text": p.text or ""} for p in content]
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        return ChatWithImages(messages, self.settings.images)

    def encode_prompt(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            return list(self.tokenizer(prompt)["input_ids"])
        return list(prompt)   # ids in the vocabulary: CompletionRequest checked them

    async def grammar(self, grammar: Any, param: Optional[str]) -> Any:
        """The request's StructuredOutput checked (400 naming `param` when it cannot be compiled in time);
        None when it has none."""
        if grammar is None:
            return None
        if self.tokenizer is None:
            raise APIError(400, "structured output needs the model's tokenizer, and this model has none",
                           param=param, code="unsupported_parameter")
        await self.grammars.check(grammar, param)
        return grammar

    def params(self, req: Any, prompt_len: int, choice: int, grammar: Any = None,
               keep_special_tokens: bool = False) -> SamplingParams:
        limit = self.info.max_model_len - prompt_len
        seed = None if req.seed is None else (req.seed + choice) % 2**64   # torch takes [-2**63, 2**64)
        try:
            sp = SamplingParams(
                max_tokens=min(req.max_new_tokens or limit, limit), temperature=req.temperature, top_p=req.top_p,
                top_k=None if req.top_k is None else max(req.top_k, 0), min_p=req.min_p,
                repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, seed=seed, stop=req.stop or [],
                stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=req.num_logprobs,
                min_tokens=min(req.min_tokens, limit), structured=grammar,
                skip_special_tokens=not keep_special_tokens)
            eos = getattr(self.tokenizer, "eos_token_id", None)
            return sp.with_defaults(self.info.generation_config, eos)
        except UserError as exc:
            raise APIError(400, str(exc)) from None

    # --- generation -----------------------------------------------------------------------------------

    async def generate(self, endpoint: str, req: Any, prompts: list[Any], request: Request, grammar: Any = None,
                       plan: Optional[ToolPlan] = None) -> Response:
        """prompts: token ids each, or one ChatWithImages (its length is known once the engine encoded it);
        grammar: the StructuredOutput every choice follows; plan: a chat request's tools."""
        max_model_len = self.info.max_model_len
        for ids in prompts:
            if isinstance(ids, ChatWithImages):
                continue
            if not ids:
                raise APIError(400, "the prompt is empty: give at least one token",
                               param="messages" if endpoint == "chat" else "prompt")
            if len(ids) >= max_model_len:
                raise APIError(400, f"the prompt has {len(ids)} tokens but this server's context holds "
                               f"{max_model_len} (prompt and answer together): shorten it",
                               param="messages" if endpoint == "chat" else "prompt",
                               code="context_length_exceeded")
        self.check_capacity(len(prompts) * req.n)
        keep = plan is not None and plan.keeps_special_tokens
        params = [[self.params(req, 0 if isinstance(ids, ChatWithImages) else len(ids), j, grammar, keep)
                   for j in range(req.n)] for ids in prompts]
        job = Job(self.loop, self.metrics, endpoint, prompts, params, request.receive)
        renderer = Renderer(endpoint, self.settings.served_model_name, self.spell_token,
                            plan.extractor if plan is not None and plan.mode != "none" else None)
        want_logprobs = req.num_logprobs is not None
        if req.stream:
            opts = req.stream_options
            chunks = renderer.stream(job, want_logprobs, bool(opts and opts.include_usage),
                                     bool(opts and opts.continuous_usage_stats))
            return EventStream(chunks, job.close)
        try:
            body = await renderer.whole(job, want_logprobs)
        finally:
            job.close()
        if body is None:   # the client left; nobody reads this
            return Response(status_code=499)
        return JSONResponse(body)


def has_image_parts(req: ChatCompletionRequest) -> bool:
    return any(isinstance(m.content, list) and any(p.type == "image_url" for p in m.content) for m in req.messages)


def _image_url(value: Any) -> Any:
    """An image_url part's URL: OpenAI's {"url": …}, or the URL itself as some clients send it."""
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise APIError(400, "an image_url part needs {\"url\": \"data:image/...;base64,...\"}",
                       param="messages", code="invalid_value")
    return value


def create_app(backend: Any, settings: AppSettings) -> FastAPI:
    """The ASGI app over `backend`: an EngineProcess (launched), an EngineLoop, or an Engine, which is
    then stepped by an EngineLoop thread. The backend starts with the app and stops with it."""
    from contextlib import asynccontextmanager

    if not isinstance(backend, EngineClient):
        backend = EngineLoop(backend)
    server = Server(backend, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop.start()
        server.grammars.warm()
        try:
            yield
        finally:
            await server.loop.stop()
            server.grammars.close()

    app = FastAPI(title="quantkit", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    if settings.allow_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allow_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        message = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                            status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("error answering %s %s", request.method, request.url.path)
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)

    async def chat_completions(request: Request) -> Response:
        server.check_auth(request)
        req = parse_request(await read_body(request, settings.limits), ChatCompletionRequest, settings.limits,
                            server.info.vocab_size)
        server.check_model(req.model)
        requested, param = requested_grammar(req)
        plan = plan_tools(req, server.tool_parser, requested)
        if has_image_parts(req):  # the engine's side runs the vision tower, between its steps
            prompt = server.encode_image_messages(req)
        else:
            prompt = server.encode_messages(req, plan.tools)
        # A forced call's grammar, or auto's (which holds the request's own), else the request's own.
        grammar = await server.grammar(*((plan.grammar, plan.param) if plan.grammar else (requested, param)))
        return await server.generate("chat", req, [prompt], request, grammar, plan)

    async def completions(request: Request) -> Response:
        server.check_auth(request)
        req = parse_request(await read_body(request, settings.limits), CompletionRequest, settings.limits,
                            server.info.vocab_size)
        server.check_model(req.model)
        prompts = [server.encode_prompt(p) for p in req.prompts()]
        grammar = await server.grammar(*requested_grammar(req))
        return await server.generate("completions", req, prompts, request, grammar)

    async def models(request: Request) -> JSONResponse:
        server.check_auth(request)
        card = {"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "quantkit",
                "max_model_len": server.info.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        """200 while the engine serves; 503 while it restarts (with Retry-After) or once it failed."""
        loop = server.loop
        if loop.alive:
            return JSONResponse({"status": "ok", "engine_restarts": loop.restarts})
        retry = loop.retry_after
        return JSONResponse({"status": loop.state, "error": loop.error or "the engine is not running",
                             "engine_restarts": loop.restarts}, status_code=503,
                            headers={"Retry-After": str(retry)} if retry else None)

    async def metrics(request: Request) -> PlainTextResponse:
        text = server.metrics.render(server.loop.stats(), server.loop.num_in_flight, server.loop.restarts,
                                     server.loop.alive)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def page(request: Request) -> Response:
        html = importlib.resources.files("quantkit.server").joinpath("static").joinpath("chat.html")
        if not html.is_file():
            raise APIError(404, "this installation has no chat page (quantkit/server/static/chat.html)",
                           type="not_found")
        return HTMLResponse(html.read_text(encoding="utf-8"))

    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST", "GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST", "GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    app.add_api_route("/", page, methods=["GET"])
    return app
