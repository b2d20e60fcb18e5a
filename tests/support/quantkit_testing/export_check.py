"""The export holds what quantization left in memory (tests/quantize).

The in-memory model keeps each quantized weight in the model's dtype (fp16): the fp16 rounding of the
value its codes and scales give. The exported codes and fp16 scales, loaded in fp32, give that value
unrounded. So the comparison is split where the two differ: the weights bit for bit after that one
rounding, then the logits of the same fp32 weights through both module stacks, to fp32 summation-order
noise. (Comparing the logits of the fp16-rounded and the fp32 weights needs a tolerance that depends on
the machine's summation order and the model's depth: 1.7e-3 here, 2.1e-3 on another CPU.)"""

from __future__ import annotations

import copy

import torch

# fp32 logits of one function computed by two module stacks (transformers' Linear vs QuantLinear): bitwise
# equal on the tiny models here (llama, qwen2/3, InternLM2; AWQ and compressed-tensors, 4 and 8 bits);
# 1e-5 of their scale leaves room for another CPU's summation order. A wrong code, scale or zero already
# fails the bitwise weight check before it.
LOGITS_REL_TOL = 1e-5


def assert_export_is_the_in_memory_model(memory_model, exported, ids: torch.Tensor) -> None:
    """`memory_model`: the model quantize() left in memory (any float dtype); `exported`: the checkpoint
    loaded by quantkit.load in fp32. Every quantized linear of the export, dequantized, rounds to the
    in-memory weight exactly; with those fp32 weights in the in-memory model, the logits agree."""
    memory = copy.deepcopy(memory_model).float().eval()
    modules = dict(memory.named_modules())
    replaced = 0
    with torch.no_grad():
        for name, module in exported.named_modules():
            if not hasattr(module, "dequantized_weight"):
                continue
            w = module.dequantized_weight().float()
            kept = modules[name].weight
            rounded = w.to(memory_model.dtype).float()
            assert torch.equal(rounded, kept), (f"{name}: the export's weight is not the in-memory one "
                                                f"(max diff {(rounded - kept).abs().max():.3e})")
            kept.copy_(w)
            replaced += 1
        assert replaced > 0, "the export holds no quantized linear"
        want = memory(ids).logits
        got = exported(ids).logits
    assert torch.isfinite(got).all()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= LOGITS_REL_TOL, f"logits of the same weights differ by {err:.2e} of their scale"


def rtn_export(src, text_file, out, fmt: str):
    """A W4 g32 round-to-nearest export of `src` in `fmt`, with KV statistics from `text_file`."""
    import quantkit
    from quantkit.config import QuantizeConfig, WeightQuantConfig

    cfg = QuantizeConfig(method="rtn", weight=WeightQuantConfig(4, 32), format=fmt)
    return quantkit.quantize(str(src), cfg, work_dir=out, progress=False, kv_calib=str(text_file)).work_dir
