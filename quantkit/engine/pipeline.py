"""`quantkit.pipeline`: batch generation and streaming over the engine, lmdeploy's pipeline shape.

    pipe = quantkit.pipeline("MODEL_DIR", EngineConfig(cache_max_entry_count=0.2, kv_bits=8))
    pipe(["Hi, pls intro yourself", "上海是"])          → [Response, Response]
    pipe([[{"role": "system", ...}, {"role": "user", ...}]])  (chat messages, multi-turn)
    for r in pipe.stream("上海是"): print(r.text, end="")
    pipe(("describe this image", quantkit.load_image("tiger.jpeg")))   (a LLaVA checkpoint)

A string prompt goes through the tokenizer's chat template as one user turn when the tokenizer has a
template (`chat_template=False` feeds it raw); any number of prompts go through the scheduler together.
A (text, image) or (text, [images]) tuple is one user turn with its images, for checkpoints that take
images (their processor's chat template places them).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

from quantkit.engine.config import EngineConfig, SamplingParams
from quantkit.engine.llm_engine import Engine, Prompt, RequestOutput

# Keyword spellings the previous pipeline took, mapped to SamplingParams fields.
_ALIASES = {"max_new_tokens": "max_tokens"}


@dataclass
class Response:
    """One answer: its text and token ids, why it ended ("stop", "length" or "abort"), token counts."""

    text: str
    token_ids: list[int]
    finish_reason: Optional[str]
    prompt_tokens: int
    generated_tokens: int

    @classmethod
    def from_output(cls, out: RequestOutput) -> "Response":
        return cls(out.text, list(out.token_ids), out.finish_reason, out.usage.prompt_tokens,
                   out.usage.completion_tokens)


def sampling_params(params: Optional[SamplingParams], settings: dict[str, Any]) -> SamplingParams:
    """`params` with keyword overrides (SamplingParams field names, or max_new_tokens)."""
    known = {f.name for f in fields(SamplingParams)}
    base = dict(params.__dict__) if params is not None else {}
    for key, value in settings.items():
        key = _ALIASES.get(key, key)
        if key not in known:
            raise TypeError(f"unknown sampling setting {key!r}; SamplingParams has {sorted(known)}")
        base[key] = list(value) if key in ("stop", "stop_token_ids") else value
    return SamplingParams(**base)


class Pipeline:
    """Callable over prompts or chat conversations; see the module docstring."""

    def __init__(self, engine: Engine, chat_template: Optional[bool] = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        vision = getattr(engine, "vision", None)  # a LLaVA processor may hold the template its tokenizer lacks
        has_template = bool(getattr(self.tokenizer, "chat_template", None) or (vision and vision.chat_template))
        self.use_chat = has_template if chat_template is None else chat_template

    def _prompt(self, prompt: Union[Prompt, tuple]) -> Prompt:
        if is_image_prompt(prompt):  # lmdeploy's (text, image or [images]): one user turn, images first
            text, images = prompt
            images = list(images) if isinstance(images, (list, tuple)) else [images]
            return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                                 {"type": "text", "text": text}]}]
        if isinstance(prompt, str) and self.use_chat:
            return [{"role": "user", "content": prompt}]
        return prompt

    def __call__(self, prompts: Union[Prompt, Sequence[Prompt]], params: Optional[SamplingParams] = None,
                 progress: bool = True, **settings: Any) -> list[Response]:
        """Answers for one prompt or a list of them (strings, token-id lists, or message lists); a
        progress bar counts finished requests when there are several."""
        sp = sampling_params(params, settings)
        if isinstance(prompts, str) or is_image_prompt(prompts) or (prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        outputs = self.engine.generate([self._prompt(p) for p in prompts], sp, progress=progress)
        return [Response.from_output(o) for o in outputs]

    def stream(self, prompt: Prompt, params: Optional[SamplingParams] = None,
               **settings: Any) -> Iterator[Response]:
        """One prompt's answer as it comes: each Response holds the new text and token ids."""
        for out in self.engine.stream(self._prompt(prompt), sampling_params(params, settings)):
            yield Response.from_output(out)


def is_image_prompt(prompt: Any) -> bool:
    """Whether `prompt` is lmdeploy's image prompt: a (text, image) or (text, [images]) tuple."""
    return isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[0], str) and not isinstance(prompt[1], str)


def pipeline(path: Union[str, Path], config: Optional[EngineConfig] = None, chat_template: Optional[bool] = None,
             **engine_settings: Any) -> Pipeline:
    """An engine over the checkpoint at `path`; `engine_settings` override fields of `config`
    (kv_bits=8, device="cpu", cache_max_entry_count=0.2, …)."""
    config = config or EngineConfig()
    if engine_settings:
        config = EngineConfig(**{**config.__dict__, **engine_settings})
    return Pipeline(Engine(path, config), chat_template)
