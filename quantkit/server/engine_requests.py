"""What crosses between the HTTP side and the engine's step loop: a request's prompt (token ids or a chat
with images), one step's lean outputs, a request's failure, and what the HTTP side knows of the engine.
Plain data, pickled across the engine process's pipes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

from quantkit.config import UserError
from quantkit.engine.images import ImagePolicy


class EngineFailure:
    """What a request's sink receives instead of outputs when the engine could not take or finish it:
    its own input's fault (`user_error`: 400), the engine's (500), or the engine is restarting
    (`retry_after` seconds: 503, the client may send it again)."""

    def __init__(self, message: str, user_error: bool, retry_after: Optional[int] = None) -> None:
        self.message, self.user_error, self.retry_after = message, user_error, retry_after
        self.finished = True

    @property
    def status(self) -> int:
        return 400 if self.user_error else 503 if self.retry_after is not None else 500


class StepOutput(NamedTuple):
    """One step's news for one request (the engine's RequestOutput, lean: it crosses a pipe each step)."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]
    prompt_tokens: int
    logprobs: Optional[list]


def lean(outputs: list) -> list[tuple]:
    """RequestOutputs as plain (request_id, *StepOutput fields) tuples: pickled 3× faster than the objects."""
    return [(o.request_id, o.text, o.token_ids, o.finished, o.finish_reason, o.usage.prompt_tokens, o.logprobs)
            for o in outputs]


Sink = Callable[[Any], None]   # receives StepOutputs, then maybe an EngineFailure; event-loop thread


@dataclass
class ChatWithImages:
    """A chat prompt with image parts: the engine's side runs the vision tower on it, reading the images as
    the server's policy allows (data: URLs; local files only under its --allowed-local-media-path)."""

    messages: list[dict]
    images: ImagePolicy = field(default_factory=ImagePolicy.served)


def add_to_engine(engine: Any, request_id: str, prompt: Any, params: Any) -> None:
    """engine.add_request, after the vision tower for a ChatWithImages (UserErrors for bad images)."""
    if isinstance(prompt, ChatWithImages):
        if getattr(engine, "vision", None) is None:
            raise UserError("this model takes no images (it has no vision tower): send text content only")
        prompt = engine.vision.encode(prompt.messages, prompt.images)
    engine.add_request(prompt, params, request_id)


@dataclass
class EngineInfo:
    """What the HTTP side needs to know of the engine: to tokenize, resolve sampling settings and check
    lengths and capacity."""

    tokenizer: Any
    generation_config: Any
    max_model_len: int      # tokens one sequence may hold (prompt and answer)
    max_num_seqs: int
    vocab_size: int
    num_blocks: int
    block_size: int
    has_vision: bool = False   # takes image parts (a LLaVA checkpoint)

    @classmethod
    def of(cls, engine: Any) -> "EngineInfo":
        return cls(engine.tokenizer, engine.generation_config, engine.scheduler.max_model_len,
                   engine.config.max_num_seqs,
                   engine.model.config.vocab_size, engine.block_manager.num_blocks, engine.config.block_size,
                   getattr(engine, "vision", None) is not None)
