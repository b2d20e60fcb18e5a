"""Helpers of the GPU tests (tests/gpu): relative error, CUDA-graph capture, a small Llama on disk.

Nothing here imports Triton: the CPU test session collects tests/gpu before tests/kernels, whose
conftest must set TRITON_INTERPRET before any kernel module is imported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from quantkit.kernels.capture import graph_warmup


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; inf when `out` holds NaN or Inf."""
    if not torch.isfinite(out).all():
        return float("inf")
    o, r = out.double(), ref.double()
    return ((o - r).norm() / r.norm()).item()


def capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its output buffer) for `fn`, captured as the runtime does: a warm-up on a side stream
    marked as graphed (so the dispatch compiles the kernels the capture will launch), then the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), graph_warmup():
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    assert out.is_cuda, "the captured function returned a host tensor: nothing replays into it"
    return graph, out


def write_small_llama(directory: Path, seed: int = 0) -> Path:
    """A random fp16 Llama checkpoint with real kernel shapes: 4 layers, hidden 1024 (8 heads of 128,
    4 KV heads), MLP 2816, every input dimension a multiple of 128; the tests' tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit_testing.tiny import make_tokenizer

    config = LlamaConfig(vocab_size=320, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # linears and embeddings N(0, 0.02)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.half().save_pretrained(str(directory))
    make_tokenizer().save_pretrained(str(directory))
    return directory
