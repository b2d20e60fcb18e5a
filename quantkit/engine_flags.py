"""The engine's command-line flags, declared once: every command that runs the engine takes them with the same
names, defaults and help, and `engine_config` turns them into an `EngineConfig` (whose checks say what is allowed)."""

from __future__ import annotations

from typing import Any, Optional

import typer

KV_BITS_HELP = ("KV cache bits: 16 stores K and V in the model's dtype; 8 int8 and 4 packed int4 codes with an fp16 "
                "scale and uint8 zero per token and head (--kv-scales online), or per layer and head (static); KV4 "
                "online keys are centred and rotated first (--kv-rotation).")
KV_BITS = typer.Option(16, "--kv-bits", help=KV_BITS_HELP)
KV_BITS_EACH = typer.Option([16], "--kv-bits", help=KV_BITS_HELP)  # evaluations: one row per value given
KV_SCALES = typer.Option("online", "--kv-scales", help="With --kv-bits 8/4: online (each token's own range) or "
                         "static (per-head ranges from the model's quantkit/kv_stats.safetensors, written by "
                         "quantkit kv-calibrate or quantkit awq).")
KV_STATS = typer.Option(None, "--kv-stats", help="A KV statistics .safetensors file (or a folder holding one) for "
                        "--kv-scales static (default: the checkpoint's own).")
KV_ROTATION = typer.Option("auto", "--kv-rotation", help="auto: at --kv-bits 4 with online scales, keys are centred "
                           "(on the checkpoint's KV statistics, when it has them) and Hadamard-rotated, q with them, "
                           "before coding (attention unchanged, int4 keys keep their quality); hadamard: at any bits; "
                           "none: lmdeploy's plain per-token codes.")
DEVICE = typer.Option(None, "--device", help="cpu, cuda or cuda:N (default: cuda when present).")
DTYPE = typer.Option("auto", "--dtype", help="Activations and unquantized weights: auto, float16 or bfloat16. "
                     "auto takes the checkpoint's torch_dtype on CUDA (bfloat16 stays bfloat16, float32 becomes "
                     "bfloat16, float16 or none is float16; AWQ exports always float16) and float32 on the CPU.")
CACHE_FRACTION = typer.Option(0.8, "--cache-max-entry-count", help="Fraction of the GPU memory free after the "
                              "weights that the KV pool takes.")


def engine_config(kv_bits: int, kv_scales: str, kv_stats: Optional[str], kv_rotation: str, device: Optional[str],
                  dtype: str, **more: Any):
    """The `EngineConfig` of these flags and `more` of its fields, checked (the device too) before any model loads."""
    from quantkit.config import check_device
    from quantkit.engine.config import EngineConfig

    check_device(device)
    return EngineConfig(kv_bits=kv_bits, kv_scales=kv_scales, kv_stats=kv_stats, kv_rotation=kv_rotation,
                        device=device, dtype=dtype, **more)
