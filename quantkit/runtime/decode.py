"""Token-by-token generation over a static KV cache, with decode steps replayed from a CUDA graph.

Why: a decode step of a quantized model launches a few hundred small kernels; launched one by one
from Python, each Triton launch costs tens of µs, several times what the kernel itself takes (see
BENCHMARKS.md, "Kernels"). A CUDA graph replays the whole step with one launch.

How: the prompt is prefilled eagerly into a transformers `StaticCache` (fixed-size key/value
buffers). Every decode step then runs on fixed input buffers (token ids, positions, cache position and
a 4-D additive attention mask over the whole cache, which transformers takes as given), so the step
is the same sequence of kernels on the same addresses each time: the first step runs eagerly (it
compiles the kernels and allocates their buffers), the second is captured, and every later one is a
replay. Without CUDA (or with `use_graph=False`) the same loop runs eagerly, which is how the tests
check it against `model.generate` on the CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch

from quantkit.kernels.capture import graph_warmup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 and top_p 1 = no filtering."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0


def sample(logits: torch.Tensor, s: Sampling, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next token ids [B] from logits [B, V]."""
    if s.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / s.temperature
    if s.top_k > 0:
        kth = torch.topk(logits, min(s.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (keep at least one).
        drop_sorted = probs.cumsum(dim=-1) - probs > s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


def _static_cache(model: torch.nn.Module, batch: int, max_len: int, device: torch.device, dtype: torch.dtype):
    from transformers import StaticCache

    try:  # transformers 5: layers allocate themselves at the first update
        return StaticCache(config=model.config, max_cache_len=max_len)
    except TypeError:  # transformers 4.x
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=max_len, device=device, dtype=dtype)


class StaticDecoder:
    """Prefill, then one token per `step`, on a static cache; CUDA-graph replay when `use_graph`."""

    def __init__(self, model: torch.nn.Module, batch: int, max_len: int, use_graph: bool) -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.max_len = max_len
        self.use_graph = use_graph and self.device.type == "cuda"
        self.cache = _static_cache(model, batch, max_len, self.device, self.dtype)
        from quantkit.runtime.kv_cache import cache_arg_name

        self.cache_arg = cache_arg_name(model)  # "cache" in newer transformers, "past_key_values" before
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=self.device)
        self.cache_position = torch.zeros(1, dtype=torch.long, device=self.device)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=self.device)  # attendable slots
        self.length = 0  # cache slots filled
        self.steps = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.graph_logits: Optional[torch.Tensor] = None

    def _mask(self, queries: int) -> torch.Tensor:
        """Additive mask [B, 1, queries, max_len]. One query (a decode step) sees every valid slot: slots
        are marked valid as they fill, so this reads only the `valid` buffer and stays right when a CUDA
        graph replays it. Several queries (the prefill) also need the causal limit."""
        ok = self.valid[:, None, None, :]
        if queries > 1:
            q_slot = self.length - queries + torch.arange(queries, device=self.device)
            ok = ok & (torch.arange(self.max_len, device=self.device)[None, :] <= q_slot[:, None])[None, None]
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(ok, zero, torch.finfo(self.dtype).min)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=ids, attention_mask=self._mask(ids.shape[1]), position_ids=positions,
            cache_position=cache_position, use_cache=True, logits_to_keep=1, **{self.cache_arg: self.cache},
        )
        return out.logits[:, -1]

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] after the (left-padded) prompts."""
        n = input_ids.shape[1]
        if n >= self.max_len:
            raise ValueError(f"the prompt ({n} tokens) does not fit the cache ({self.max_len})")
        self.valid[:, :n] = attention_mask.bool()
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        self.length = n
        logits = self._forward(input_ids, positions, torch.arange(n, device=self.device))
        self.positions.copy_(positions[:, -1:])
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row [B]; logits [B, V] for the next."""
        if self.length >= self.max_len:
            raise ValueError("the static cache is full")
        self.ids.copy_(tokens.view(-1, 1))
        self.positions.add_(1)
        self.cache_position.fill_(self.length)
        self.valid[:, self.length] = True
        self.length += 1
        self.steps += 1
        if not self.use_graph:
            return self._forward(self.ids, self.positions, self.cache_position)
        if self.steps == 1:  # eager, warming up the kernels the capture will launch
            with graph_warmup():
                return self._forward(self.ids, self.positions, self.cache_position)
        if self.graph is None:
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    self.graph_logits = self._forward(self.ids, self.positions, self.cache_position)
            except RuntimeError as exc:  # a forward that cannot be captured (a host sync inside): stay eager
                log.warning("CUDA-graph capture failed, decoding eagerly: %s", str(exc).splitlines()[0])
                self.use_graph = False
                return self._forward(self.ids, self.positions, self.cache_position)
            self.graph = graph
        self.graph.replay()
        return self.graph_logits


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    use_graph: bool = True,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Prompt ids followed by up to `max_new_tokens` new ids per row, [B, prompt + new] (rows that
    finish early are padded with `pad_id`, as `model.generate` does)."""
    batch, n = input_ids.shape
    dec = StaticDecoder(model, batch, n + max_new_tokens, use_graph)
    logits = dec.prefill(input_ids, attention_mask)
    eos = torch.tensor(list(eos_ids) or [-1], device=input_ids.device)
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    out = [input_ids]
    for i in range(max_new_tokens):
        tok = sample(logits, sampling, generator)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        out.append(tok[:, None])
        done |= torch.isin(tok, eos)
        if i == max_new_tokens - 1 or bool(done.all()):
            break
        logits = dec.step(tok)
    return torch.cat(out, dim=1)


def fits_static_cache(model: Any, total_len: int) -> bool:
    """Whether `total_len` tokens fit this loop: a sliding-window model's static cache rolls over past
    its window, which the loop's absolute-slot mask does not follow (`generate` handles that case)."""
    window = getattr(model.config, "sliding_window", None)
    uses_window = getattr(model.config, "use_sliding_window", True) is not False
    return not (isinstance(window, int) and uses_window and total_len > window)


def graphs_available(model: Any) -> bool:
    """CUDA-graph decoding applies to a model on CUDA with the plain (unquantized) KV cache."""
    try:
        device = next(model.parameters()).device
    except StopIteration:
        return False
    from quantkit.runtime.kv_cache import kv_cache_factory

    return device.type == "cuda" and kv_cache_factory(model) is None
