"""compressed-tensors float-quantized (FP8): the tensors and config llm-compressor writes for FP8_DYNAMIC
and FP8, the registry telling it from pack-quantized, e4m3 rounding within its grid, fusing exact."""

import pytest
import torch

from quantkit.formats import fp8
from quantkit.formats.registry import FORMATS, QUANT_METHODS, UnsupportedFormat, format_of

# What llm-compressor writes for one QuantizationArgs (every field; compressed-tensors forbids others).
ARG_KEYS = {"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
            "observer", "observer_kwargs"}


def config(activations="dynamic", strategy="channel"):
    return fp8.quantization_config(fp8.Fp8Layout(weight_strategy=strategy, activations=activations), ["lm_head"])


@pytest.mark.parametrize("activations,strategy", [("dynamic", "channel"), ("static", "tensor"), ("dynamic", "tensor")])
def test_config_is_llm_compressors(activations, strategy):
    c = config(activations, strategy)
    assert {k: c[k] for k in ("quant_method", "format", "quantization_status", "ignore", "kv_cache_scheme")} == {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None}
    (group,) = c["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["format"] == "float-quantized" and group["output_activations"] is None
    w, a = group["weights"], group["input_activations"]
    assert set(w) == set(a) == ARG_KEYS
    assert {k: w[k] for k in ("num_bits", "type", "strategy", "symmetric", "dynamic", "group_size")} == {
        "num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False, "group_size": None}
    want_a = ("token", True) if activations == "dynamic" else ("tensor", False)
    assert (a["num_bits"], a["type"], a["symmetric"], a["strategy"], a["dynamic"]) == (8, "float", True, *want_a)
    assert fp8.FORMAT.read_layout(c) == fp8.Fp8Layout(weight_strategy=strategy, activations=activations)


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_compressed_tensors_parses_the_config(activations):
    ct = pytest.importorskip("compressed_tensors.quantization")
    parsed = ct.QuantizationConfig.model_validate(config(activations))
    scheme = parsed.config_groups["group_0"]
    assert scheme.weights.type == "float" and scheme.input_activations.dynamic is (activations == "dynamic")
    assert parsed.format == "float-quantized"


def test_registry_tells_the_two_compressed_tensors_formats_apart():
    assert FORMATS["float-quantized"] is fp8.FORMAT and QUANT_METHODS == ("awq", "compressed-tensors")
    assert format_of(config()) is fp8.FORMAT
    int_qc = FORMATS["compressed-tensors"].write_config(FORMATS["compressed-tensors"].read_layout(
        {"config_groups": {"g": {"weights": {"num_bits": 8, "strategy": "channel", "symmetric": True}}}}), [])
    assert format_of(int_qc) is FORMATS["compressed-tensors"]
    assert format_of({"quant_method": "compressed-tensors", "config_groups": int_qc["config_groups"]}) is FORMATS[
        "compressed-tensors"]  # no format field: pack-quantized, as before
    with pytest.raises(UnsupportedFormat, match="'sparse-bitmask' is not supported.*float-quantized"):
        format_of({"quant_method": "compressed-tensors", "format": "sparse-bitmask"})


@pytest.mark.parametrize("change,needle", [
    (lambda g: g["weights"].update(strategy="block", block_structure=[128, 128]), "strategy 'block'"),
    (lambda g: g["weights"].update(type="int"), "type 'int'"),
    (lambda g: g.update(input_activations=None), "activations None"),
    (lambda g: g["input_activations"].update(strategy="group", group_size=128), "activations"),
    (lambda g: g["input_activations"].update(dynamic=False), "activations"),
])
def test_fp8_it_cannot_run_is_refused(change, needle):
    qc = config()
    change(qc["config_groups"]["group_0"])
    with pytest.raises(UnsupportedFormat, match=needle):
        format_of(qc)


def test_tensors_names_dtypes_shapes():
    w = torch.randn(6, 10)
    ch = fp8.pack_fp8(fp8.encode_e4m3(w, torch.full((6, 1), 0.01)), torch.full((6, 1), 0.01))
    assert {k: (t.dtype, tuple(t.shape)) for k, t in ch.items()} == {
        "weight": (torch.float8_e4m3fn, (6, 10)), "weight_scale": (torch.float32, (6, 1))}
    st = fp8.FORMAT.pack(fp8.encode_e4m3(w, torch.tensor([0.01])), None, torch.tensor([0.01]),
                         fp8.Fp8Layout(weight_strategy="tensor", activations="static"), input_scale=torch.tensor(0.5))
    assert {k: (t.dtype, tuple(t.shape)) for k, t in st.items()} == {
        "weight": (torch.float8_e4m3fn, (6, 10)), "weight_scale": (torch.float32, (1,)),
        "input_scale": (torch.float32, (1,))}
    assert fp8.FORMAT.holds(st) and not fp8.FORMAT.holds({"weight": w})  # a full-precision linear is not FP8
    with pytest.raises(ValueError, match="need input_scale"):
        fp8.FORMAT.pack(st["weight"], None, st["weight_scale"], fp8.Fp8Layout(activations="static"))


def e4m3_step(v: torch.Tensor) -> torch.Tensor:
    """The spacing of the e4m3 grid at |v| (float64): 2^(e−3) for normals, 2^−9 below 2^−6."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0**-6)))
    return torch.exp2(e - 3)


def test_encode_rounds_to_the_nearest_grid_value():
    torch.manual_seed(0)
    scale = torch.rand(64, 1, dtype=torch.float64) + 0.01
    w = torch.randn(64, 256, dtype=torch.float64) * scale * 100
    w[0, :4] = torch.tensor([0.0, 1e-9, 500.0, -1e4]) * scale[0]  # zero, a subnormal, past ±448: saturated
    x = w / scale
    back = fp8.encode_e4m3(w, scale).double()
    # Within half a step of its own grid spacing (the saturated ones at ±448), and on the grid.
    err = (back - x.clamp(-448, 448)).abs()
    assert (err <= e4m3_step(x.clamp(-448, 448)) / 2 + 1e-12).all()
    assert back[0, 2] == 448 and back[0, 3] == -448 and back[0, 0] == 0
    assert torch.equal(fp8.encode_e4m3(back, torch.ones(1)).double(), back)


def test_round_trip_and_dequantize():
    torch.manual_seed(1)
    w = torch.randn(12, 40)
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    t = fp8.pack_fp8(fp8.encode_e4m3(w, scale), scale)
    q, zeros, s = fp8.FORMAT.unpack(t, fp8.Fp8Layout())
    assert zeros is None and torch.equal(q.float(), t["weight"].float()) and torch.equal(s, scale)
    deq = fp8.dequantize_fp8(q, s)
    assert ((deq - w).abs() <= w.abs() / 16 + scale * 2.0**-10).all()  # e4m3: 3 mantissa bits
    assert (deq.abs().amax(dim=1) == w.abs().amax(dim=1)).all()  # absmax lands exactly on 448


def test_join_stacks_outputs_and_widens_tensor_scales():
    torch.manual_seed(2)
    layout = fp8.Fp8Layout(weight_strategy="tensor", activations="static")
    parts = []
    for out_f, s, i in ((8, 0.02, 0.5), (4, 0.03, 0.7), (4, 0.01, 0.6)):
        w = torch.randn(out_f, 16)
        parts.append(fp8.FORMAT.pack(fp8.encode_e4m3(w, torch.tensor([s])), None, torch.tensor([s]), layout,
                                     input_scale=torch.tensor([i])))
    joined = fp8.FORMAT.join(parts, layout)
    assert joined["weight"].dtype == torch.float8_e4m3fn and joined["weight_scale"].shape == (16, 1)
    want = torch.cat([fp8.dequantize_fp8(p["weight"], p["weight_scale"]) for p in parts])
    assert torch.equal(fp8.dequantize_fp8(joined["weight"], joined["weight_scale"]), want)
    assert joined["input_scale"].shape == (1,) and joined["input_scale"].item() == pytest.approx(0.7)
    assert fp8.FORMAT.linear_args(joined, layout) == dict(in_features=16, out_features=16, layout="fp8",
                                                          activations="static", per_tensor=False)
