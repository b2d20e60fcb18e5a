"""End to end on the GPU: a random-weight Llama-2-7B-shape W4 g128 checkpoint through quantkit.load.

Builds the model on the GPU from a config (hidden 4096, MLP 11008, 32 heads, vocabulary 32000; the
number of decoder layers is a flag, 2 by default, since every layer has the same shapes), quantizes it
with quantkit's RTN primitives on the GPU, writes the AWQ-format checkpoint with quantkit's exporter,
loads it with quantkit.load on CUDA and compares the logits of the Triton path with the torch
reference path (KernelSettings(path="reference")), for a one-token and a multi-token input. Then times one
decoder block at batch 1, one token, W4 (Triton) against the same block in fp16, by CUDA-graph replay; and
a 64-token block forward replayed from a CUDA graph (the Gluon GEMM on Hopper; the eager forward takes the
GEMV at 64 tokens, `dispatch.EAGER_GEMV_MAX_M`) against the same forward on the reference path.

    PYTHONPATH=. python bench/kernels_e2e.py --work /tmp/e2e [--layers 2]
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import time
from pathlib import Path

import torch

from bench.lib.kernel_timing import graph_us, plain_us, rel_err
from quantkit.kernels.capture import graph_warmup
from quantkit.kernels.settings import KernelSettings


def build_checkpoint(work: Path, layers: int):
    """(fp16 model on the GPU, checkpoint path)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.config import QuantizeConfig, WeightQuantConfig
    from quantkit.models.loading import LoadedModel
    from quantkit.models.registry import spec_for_config
    from quantkit.quantize.export import write_export
    from bench.lib.common import use_test_helpers
    use_test_helpers()
    from quantkit_testing.in_memory import checkpoint_tensors, rtn_quantize
    from quantkit_testing.tiny import make_tokenizer

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                      num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).half().eval()
    spec = spec_for_config(cfg)
    wcfg = WeightQuantConfig(4, 128)
    qweights = rtn_quantize(model, spec, wcfg)  # on the GPU: the weights live there
    for qw in qweights.values():
        qw.q, qw.zeros, qw.scales = qw.q.cpu(), qw.zeros.cpu(), qw.scales.cpu()
    model.cpu()
    loaded = LoadedModel(model, make_tokenizer(), spec, "random Llama-2-7B-shape model")
    qcfg = QuantizeConfig(method="rtn", weight=wcfg)
    write_export(loaded, checkpoint_tensors(model, qweights, qcfg), qcfg, work, {"note": "kernel e2e"}, overwrite=True)
    return model.cuda(), work


def use_path(model, path: str) -> None:
    """Every quantized linear of `model` on the Triton kernels ("triton") or the torch reference."""
    kernels = KernelSettings(path=path)
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = kernels


def logits(model, ids: torch.Tensor, kernel: str) -> torch.Tensor:
    use_path(model, kernel)
    with torch.no_grad():
        return model(ids).logits.float()


def block_call(layer, model, hidden: torch.Tensor):
    pos = torch.zeros(1, hidden.shape[1], dtype=torch.long, device="cuda")
    pe = model.model.rotary_emb(hidden, pos)

    def call():
        with torch.no_grad():
            return layer(hidden, attention_mask=None, position_ids=pos, position_embeddings=pe)
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/quantkit-e2e")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import quantkit

    t0 = time.time()
    fp16_model, path = build_checkpoint(Path(args.work), args.layers)
    qmodel, _ = quantkit.load(path, device="cuda")
    print(f"checkpoint built and loaded in {time.time() - t0:.0f} s", flush=True)
    result = {"layers": args.layers}
    g = torch.Generator(device="cuda").manual_seed(1)
    # GPU memory around the first Triton forward: the kernel layout is built, the checkpoint tensors
    # move to host memory (dispatch.kernel_weights), so the accelerator should not grow by the weights.
    packed = sum(b.numel() * b.element_size() for n, b in qmodel.named_buffers()
                 if n.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    logits(qmodel, torch.randint(0, 32000, (1, 1), device="cuda", generator=g), "triton")
    torch.cuda.synchronize()
    result["packed_weight_mb"] = packed / 1e6
    result["gpu_mb_change_first_forward"] = (torch.cuda.memory_allocated() - before) / 1e6
    print(f"packed weights {packed / 1e6:.1f} MB; GPU memory change over the first forward "
          f"{result['gpu_mb_change_first_forward']:+.1f} MB", flush=True)
    for t in (1, 17, 100):  # eager: the GEMV up to 64 tokens; 100: every linear through the Gluon GEMM
        ids = torch.randint(0, 32000, (1, t), device="cuda", generator=g)
        ref, out = logits(qmodel, ids, "reference"), logits(qmodel, ids, "triton")
        result[f"logits_rel_err_tokens{t}"] = rel_err(out, ref)
        result[f"fp16_vs_w4_rel_err_tokens{t}"] = rel_err(out, logits(fp16_model, ids, "triton"))
        print(f"{t:3} tokens: logits rel err triton vs reference {result[f'logits_rel_err_tokens{t}']:.2e} "
              f"(W4 vs fp16 model {result[f'fp16_vs_w4_rel_err_tokens{t}']:.2e})", flush=True)
    # A 64-token block forward replayed from a CUDA graph (where the dispatch takes the Gluon GEMM on
    # Hopper, split K on o and down; eagerly the GEMV) against the reference path: the GEMM's TMA
    # descriptors travel in the kernel parameters the graph keeps.
    call = block_call(qmodel.model.layers[0], qmodel, torch.randn(1, 64, 4096, device="cuda", dtype=torch.float16))
    def first(out):  # decoder layers return a tuple or a tensor, by transformers version
        return out[0] if isinstance(out, tuple) else out

    use_path(qmodel, "reference")
    eager = first(call()).float()
    use_path(qmodel, "triton")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), graph_warmup():  # the kernels the capture will launch, compiled first
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = first(call())
    graph.replay()
    torch.cuda.synchronize()
    result["graph_vs_reference_rel_err_tokens64"] = rel_err(static.float(), eager)
    print(f"64-token block forward, graph replay vs the reference path: rel err "
          f"{result['graph_vs_reference_rel_err_tokens64']:.2e}",
          flush=True)
    hidden = torch.randn(1, 1, 4096, device="cuda", dtype=torch.float16)
    # Calls alternate between the decoder layers, so the weights come from memory rather than L2.
    q_calls = [block_call(layer, qmodel, hidden) for layer in qmodel.model.layers]
    f_calls = [block_call(layer, fp16_model, hidden) for layer in fp16_model.model.layers]
    for name, calls in (("w4_block", q_calls), ("fp16_block", f_calls)):
        result[name] = {"graph_us": graph_us(calls, replays=30, rounds=10), "plain_us": plain_us(calls, reps=20)}
    result["block_speedup_graph"] = result["fp16_block"]["graph_us"] / result["w4_block"]["graph_us"]
    result["block_speedup_plain"] = result["fp16_block"]["plain_us"] / result["w4_block"]["plain_us"]
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
