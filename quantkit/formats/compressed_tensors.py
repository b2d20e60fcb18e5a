"""compressed-tensors "pack-quantized", which vLLM, llm-compressor and transformers load (4 or 8 bits).

weight_packed int32 [out, ceil(in·b/32)]: values packed sequentially along the input dimension,
value k of a word in bits b·k..b·k+b−1, each stored as the signed integer plus 2^(b−1).
weight_scale [out, groups]; weight_zero_point int32 packed the same way along dim 0 (asymmetric
only); weight_shape int64 [2]. Dequantized weight: (q_signed − z_signed) · s.
quantkit's unsigned integers q ∈ [0, 2^b) map to q_signed = q − 2^(b−1), so the packed bits are q.

Static KV-cache scales, where calibration measured K and V: `<attention>.k_scale` / `.v_scale`,
float32 [1] per layer, with a `kv_cache_scheme` of 8-bit float, strategy "tensor" (what
llm-compressor writes). vLLM maps them onto its attention layers and, when `kv_cache_dtype` is left
"auto", keeps an fp8 e4m3 KV cache that stores K / k_scale. One scale per layer rather than per head
("attn_head"): vLLM takes per-head scales only on FlashAttention 3; its CPU and other backends use
one number per layer anyway (the largest head's).
"""

from __future__ import annotations

import torch

TENSOR_NAMES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")
KV_SCALE_NAMES = ("k_scale", "v_scale")
FP8_E4M3_MAX = 448.0  # the largest finite float8 e4m3 value: absmax maps onto it


def _pack_dim1(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[rows, n] ints in 0..2^b−1 → int32 [rows, ceil(n·b/32)], sequential, zero padded."""
    per_word = 32 // bits
    rows, n = values.shape
    words = -(-n // per_word)
    v = torch.zeros(rows, words * per_word, dtype=torch.int64, device=values.device)
    v[:, :n] = values.to(torch.int64)
    v = v.reshape(rows, words, per_word)
    shifts = torch.arange(0, bits * per_word, bits, dtype=torch.int64, device=v.device)
    packed = (v << shifts).sum(dim=-1)
    return (packed - (packed >= 2**31).to(torch.int64) * 2**32).to(torch.int32)


def _unpack_dim1(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per_word = 32 // bits
    shifts = torch.arange(0, bits * per_word, bits, dtype=torch.int32, device=packed.device)
    v = (packed.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return v.reshape(packed.shape[0], -1)[:, :n]


def pack_compressed(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, symmetric: bool
) -> dict[str, torch.Tensor]:
    """From quantkit's q [out, in], zeros and scales [out, groups] to pack-quantized tensors."""
    out = {
        "weight_packed": _pack_dim1(q, bits),
        "weight_scale": scales.to(torch.float16).contiguous(),
        "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64),
    }
    if not symmetric:
        out["weight_zero_point"] = _pack_dim1(zeros.t().contiguous(), bits).t().contiguous()
    return out


def unpack_compressed(tensors: dict[str, torch.Tensor], bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Back to q [out, in], zeros [out, groups] (int32) and scales [out, groups]."""
    out_f, in_f = (int(x) for x in tensors["weight_shape"].tolist())
    q = _unpack_dim1(tensors["weight_packed"], bits, in_f)
    scales = tensors["weight_scale"]
    if "weight_zero_point" in tensors and tensors["weight_zero_point"] is not None:
        zeros = _unpack_dim1(tensors["weight_zero_point"].t().contiguous(), bits, out_f).t()
    else:
        zeros = torch.full(scales.shape, 2 ** (bits - 1), dtype=torch.int32, device=scales.device)
    return q, zeros, scales


def quantization_config(bits: int, group_size: int, symmetric: bool, ignore: list[str]) -> dict:
    """The config.json entry vLLM and transformers read for a weight-only pack-quantized model."""
    strategy = "channel" if group_size == -1 else "group"
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": bits,
                    "type": "int",
                    "symmetric": symmetric,
                    "strategy": strategy,
                    "group_size": None if group_size == -1 else group_size,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
    }


def kv_cache_scheme() -> dict:
    """quantization_config["kv_cache_scheme"] for the scales of `kv_cache_scales`: fp8, per tensor."""
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False,
            "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def kv_cache_scales(attention_modules: list[str], k_absmax: torch.Tensor, v_absmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """`<module>.k_scale` / `.v_scale` for each layer's attention module: the layer's largest |K|
    (|V|) over heads and channels divided by the fp8 e4m3 maximum, float32 [1].
    `k_absmax` / `v_absmax` are [layers, ...] with one row per entry of `attention_modules`."""
    if not (len(attention_modules) == k_absmax.shape[0] == v_absmax.shape[0]):
        raise ValueError(f"{len(attention_modules)} attention modules but statistics for {k_absmax.shape[0]} layers")
    out = {}
    for i, module in enumerate(attention_modules):
        for name, absmax in zip(KV_SCALE_NAMES, (k_absmax[i], v_absmax[i])):
            # A layer whose K or V is all zero still needs a positive scale: vLLM reads ≤ 0 as "absent".
            scale = absmax.float().max().clamp_min(1e-8) / FP8_E4M3_MAX
            out[f"{module}.{name}"] = scale.reshape(1).contiguous()
    return out

