"""`pipeline()`: the simplest batch generation API over a quantkit checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from quantkit.config import UserError
from quantkit.runtime.decode import Sampling, fits_static_cache, generate, graphs_available


@dataclass
class Response:
    """One generated answer."""

    text: str
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling settings; temperature 0 means greedy decoding."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()


class Pipeline:
    """Callable over a list of prompts; applies the tokenizer's chat template when it has one."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Any, chat_template: Optional[bool] = None,
        cuda_graphs: Optional[bool] = None,
    ) -> None:
        """`cuda_graphs` (default: on CUDA with the plain KV cache) decodes over a static cache with each
        step replayed from a CUDA graph (quantkit.runtime.decode); otherwise `model.generate` runs."""
        self.model, self.tokenizer = model, tokenizer
        self.cuda_graphs = graphs_available(model) if cuda_graphs is None else cuda_graphs
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat_template is None else chat_template

    def _prompt_text(self, prompt: str) -> str:
        if not self.use_chat:
            return prompt
        messages = [{"role": "user", "content": prompt}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @torch.inference_mode()
    def __call__(
        self, prompts: Union[str, Sequence[str]], gen_config: Optional[GenerationConfig] = None, **settings: Any
    ) -> list[Response]:
        """Generate for each prompt; `settings` override fields of `gen_config` (max_new_tokens, temperature, …)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        cfg = gen_config or GenerationConfig()
        if settings:
            cfg = GenerationConfig(**{**cfg.__dict__, **{k: (tuple(v) if k == "stop" else v) for k, v in settings.items()}})
        tok = self.tokenizer
        tok.padding_side = "left"
        texts = [self._prompt_text(p) for p in prompts]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=not self.use_chat)
        check_context(self.model.config, enc["attention_mask"].sum(1).tolist(), cfg.max_new_tokens)
        device = next(self.model.parameters()).device
        enc = {k: v.to(device) for k, v in enc.items()}
        eos = set(_as_list(getattr(self.model.generation_config, "eos_token_id", None))) | {tok.eos_token_id}
        if self.cuda_graphs and fits_static_cache(self.model, enc["input_ids"].shape[1] + cfg.max_new_tokens):
            out = generate(
                self.model, enc["input_ids"], enc["attention_mask"], cfg.max_new_tokens,
                Sampling(cfg.temperature, cfg.top_p, cfg.top_k), tuple(e for e in eos if e is not None),
                tok.pad_token_id, use_graph=True,
            )
        else:
            kwargs: dict[str, Any] = {"max_new_tokens": cfg.max_new_tokens, "pad_token_id": tok.pad_token_id}
            if cfg.temperature > 0:
                kwargs.update(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k or None)
            else:
                kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            if cfg.stop:
                kwargs.update(stop_strings=list(cfg.stop), tokenizer=tok)
            out = self.model.generate(**enc, **kwargs)
        prompt_len = enc["input_ids"].shape[1]
        return [self._response(enc["attention_mask"][i], out[i, prompt_len:], eos, cfg) for i in range(len(texts))]

    def _response(self, mask: torch.Tensor, new_ids: torch.Tensor, eos: set, cfg: GenerationConfig) -> Response:
        ids = new_ids.tolist()
        finish = "length"
        for j, t in enumerate(ids):
            if t in eos:
                ids, finish = ids[:j], "stop"
                break
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        for s in cfg.stop:
            if s in text:
                text, finish = text[: text.index(s)], "stop"
        return Response(text=text, prompt_tokens=int(mask.sum()), generated_tokens=len(ids), finish_reason=finish)


def context_length(config: Any) -> Optional[int]:
    """The most positions the model was built for (None where its config does not say)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_context(config: Any, prompt_tokens: Sequence[int], max_new_tokens: int) -> None:
    """Refuse prompts that, with `max_new_tokens`, run past the model's context: beyond it the
    positions were never trained, and generation would go on silently with degraded output."""
    context = context_length(config)
    if context is None:
        return
    for i, n in enumerate(prompt_tokens, 1):
        if n >= context:
            raise UserError(f"prompt {i} has {n} tokens, the model's context is {context}: shorten the prompt")
        if n + max_new_tokens > context:
            raise UserError(f"prompt {i} has {n} tokens; with --max-new-tokens {max_new_tokens} it would pass the "
                            f"model's context of {context}: use --max-new-tokens {context - n} or less")


def _as_list(x: Any) -> list:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def pipeline(
    path: Union[str, Path], kv_bits: Optional[int] = None, device: Optional[str] = None,
    cuda_graphs: Optional[bool] = None, **load_kwargs: Any,
) -> Pipeline:
    """Load a checkpoint and return a `Pipeline`: ``pipeline(path)(["Hi", "上海是"])`` → [Response, …].

    `cuda_graphs` is passed to `Pipeline` (default: on for CUDA with the plain KV cache)."""
    from quantkit.runtime.loader import load

    model, tok = load(path, device=device, kv_bits=kv_bits, **load_kwargs)
    return Pipeline(model, tok, cuda_graphs=cuda_graphs)
