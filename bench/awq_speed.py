"""AWQ speed and memory on a Llama-2-7B-shape model with random weights (the issue's GPU target).

    PYTHONPATH=. python -m bench.awq_speed --out /tmp/awq7b            # on the H200
    python -m bench.awq_speed --tiny --device cpu --out /tmp/awq-tiny   # the same path, seconds on a CPU

The model is built on the CPU in fp16 (weights drawn on the GPU when there is one, which is much
faster than the CPU's generator), calibrated with 128 random-token windows of 512, W4 g128, written
as AWQ gemm. Reported: the end-to-end time of quantize + write with its phases, peak GPU memory
(torch's allocator), and the process's peak resident memory against the fp16 model's size.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import time
from pathlib import Path

import torch

from quantkit.config import build_config
from quantkit.models.loading import LoadedModel
from quantkit.models.registry import spec_for_config
from quantkit.quantize import export
from quantkit.quantize.awq import awq_quantize

LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024)


class NoTokenizer:
    """Random tokens need no tokenizer; the export asks one to save itself, and there is nothing to save."""

    def save_pretrained(self, directory: str) -> None:
        pass


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2


@torch.no_grad()
def random_model(shape: dict, gen_device: str):
    """An fp16 LlamaForCausalLM on the CPU with N(0, 0.02) weights and norms near 1, built tensor by tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if p.ndim == 1:
            t = torch.rand(p.shape, device=gen_device) * 0.5 + 0.75
        else:
            t = torch.randn(p.shape, device=gen_device, dtype=torch.float16) * 0.02
        p.data = t.to(device="cpu", dtype=torch.float16)
    # Buffers (rotary inv_freq) were left uninitialised by to_empty: rebuild that module on the CPU.
    model.model.rotary_emb = type(model.model.rotary_emb)(config)
    return model.half().eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a 3-layer model for checking the path on a CPU")
    ap.add_argument("--device", default=None)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--out", type=Path, required=True, help="checkpoint directory (overwritten)")
    ap.add_argument("--report", type=Path, default=None, help="write the figures here as JSON")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads; on a busy 2-core machine 1 is faster than 2 (OpenMP waits on descheduled threads)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # one line per block: losses, ratios
    shape = TINY if args.tiny else LLAMA2_7B
    gen_device = "cuda" if torch.cuda.is_available() else "cpu"
    rss0 = peak_rss_gb()
    t0 = time.perf_counter()
    model = random_model(shape, gen_device)
    build_s = time.perf_counter() - t0
    model_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1024**3
    rss_model = peak_rss_gb()
    windows = torch.randint(0, shape["vocab_size"], (args.samples, args.seqlen), generator=torch.Generator().manual_seed(0))
    config = build_config(method="awq", device=args.device, **{
        "weight.bits": 4, "weight.group_size": 128, "calib.samples": args.samples, "calib.seqlen": args.seqlen})
    loaded = LoadedModel(model, NoTokenizer(), spec_for_config(model.config), "random Llama-2-7B shape")
    report: dict = {"method": "awq", "config": config.to_dict()}
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # The same steps as quantkit.quantize(), with the fp weights released block by block (the caller
    # keeps no use for them), and the export's packing timed apart from the writing.
    t1 = time.perf_counter()
    qweights = awq_quantize(model, loaded.spec, config, windows, report, progress=True, release_weights=True)
    quantize_s = time.perf_counter() - t1
    pack_s = {}
    inner = export.checkpoint_tensors

    def timed_checkpoint_tensors(*a, **k):
        t = time.perf_counter()
        out = inner(*a, **k)
        pack_s["pack"] = time.perf_counter() - t
        return out

    export.checkpoint_tensors = timed_checkpoint_tensors
    t2 = time.perf_counter()
    export.write_export(loaded, qweights, config, args.out, report, overwrite=True)
    write_s = time.perf_counter() - t2
    total_s = time.perf_counter() - t1
    phases = dict(report["awq"]["phases_s"], pack=round(pack_s["pack"], 2), write=round(write_s - pack_s["pack"], 2))
    size_gb = sum(f.stat().st_size for f in args.out.glob("*.safetensors")) / 1024**3
    result = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "shape": shape, "windows": list(windows.shape), "build_model_s": round(build_s, 1),
        "quantize_s": round(quantize_s, 1), "end_to_end_s": round(total_s, 1), "phases_s": phases,
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1024**3, 2) if torch.cuda.is_available() else None,
        "fp16_model_gb": round(model_gb, 2), "peak_host_gb": round(peak_rss_gb(), 2),
        "host_before_model_gb": round(rss0, 2), "host_after_model_gb": round(rss_model, 2),
        "host_ratio": round(peak_rss_gb() / model_gb, 3), "checkpoint_gb": round(size_gb, 2),
        "fallbacks": report["awq"]["fallbacks"][:5], "versions": {"torch": torch.__version__},
    }
    print(json.dumps(result, indent=2))
    print(f"\n| figure | value |\n|---|---|\n| end to end (quantize + pack + write) | {total_s:.1f} s |")
    for k, v in phases.items():
        print(f"| {k} | {v:.1f} s |")
    print(f"| peak GPU memory | {result['peak_gpu_gb']} GB |\n| peak host memory | {result['peak_host_gb']} GB "
          f"({result['host_ratio']}x the {model_gb:.1f} GB fp16 model) |")
    if args.report:
        args.report.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
